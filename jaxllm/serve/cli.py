"""`jaxllm serve RUN_DIR|HF_DIR [--host H] [--port P] [--kv-cache-dtype D] [--max-num-seqs N]
[--page-size N] [--kv-group N] [--swap host|recompute] [--api-key KEY] [--precompile]
[--precompile-scoring]
[key=value ...]`: load a model, start the engine's thread and uvicorn. `engine.KEY=VALUE` overrides set the engine's flags
(`engine.swap=host` is `--swap host`); the other overrides are the model's.

The engine runs on the run's mesh (its `mesh` section; `mesh.tensor=2`-style overrides change it,
as for `jaxllm generate`), or for a Hugging Face directory on the mesh its overrides describe.

SIGTERM (or Ctrl-C) stops accepting requests, cancels those in flight after a short grace and
exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import signal
import socket
from pathlib import Path

from jaxllm.config import ConfigError, split_args
from jaxllm.config.sections import KV_CACHE_DTYPE


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine")
    s.add_argument("args", nargs="+", metavar="RUN_DIR|HF_DIR|key=value")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--kv-cache-dtype",
        default=KV_CACHE_DTYPE,
        choices=("bfloat16", "float32", "int8", "int4", "int2"),
    )
    s.add_argument("--max-num-seqs", type=int, default=8, help="sequences batched at a time")
    s.add_argument(
        "--page-size",
        type=int,
        help="tokens per KV page (default 16; with int4 / int2 the quantization group, 32)",
    )
    s.add_argument(
        "--kv-group", type=int, default=32, help="int4 / int2: tokens per quantization group"
    )
    s.add_argument("--num-pages", type=int, help="KV pages (default: max-num-seqs full contexts)")
    s.add_argument("--chunk-size", type=int, default=32, help="prefill tokens per step")
    s.add_argument(
        "--swap",
        default="recompute",
        choices=("recompute", "host"),
        help="a sequence preempted when the KV pages run out is recomputed later, or its "
        "pages are copied to host memory and back",
    )
    s.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1 routes")
    s.add_argument("--served-model-name", help="the model id clients name (default: the dir's)")
    s.add_argument(
        "--precompile",
        action="store_true",
        help="compile the engine's step for every (tokens per slot, table width) bucket before "
        "listening, so no request waits on a compile",
    )
    s.add_argument(
        "--precompile-scoring",
        action="store_true",
        help="compile, for every bucket too, the step that returns the prompt's "
        "log-probabilities (echo with logprobs, prompt_logprobs: lm-evaluation-harness's "
        "loglikelihood requests) before listening",
    )
    s.add_argument(
        "--allowed-local-media-path",
        metavar="DIR",
        help="chat image parts may name local files under DIR (a path or file:// URL); "
        "without it images come as data: URLs only",
    )
    s.set_defaults(func=cmd_serve)


@dataclasses.dataclass
class Loaded:
    """A model to serve, on the mesh it was loaded onto, with its tokenizer's stops and BOS."""

    model: object
    tok: object
    stops: set[int]
    bos: list[int]
    mesh: object
    """The `jax.sharding.Mesh` its parameters live on (the engine runs on it)."""
    mesh_config: object
    """The `MeshConfig` that made it (its parallel settings, such as expert_dispatch)."""


def load_run(path, overrides=()) -> Loaded:
    """The model of a run directory (on the run's mesh) or a Hugging Face directory (on the
    mesh of its `mesh.*` overrides), with its tokenizer, stop ids and bos ids."""
    from jaxllm import sharding
    from jaxllm.data.tokenizer import generation_config, generation_stop_ids, make_tokenizer
    from jaxllm.load import _is_hf_source, load_model, model_config, resolve

    if _is_hf_source(Path(path)):
        cfg, run_dir = model_config(Path(path), list(overrides)), Path(path)
        mesh = sharding.make_mesh(cfg.mesh)
        model = load_model(path, mesh=mesh, overrides=list(overrides))
    else:
        from jaxllm.infer.cli import _check_generates
        from jaxllm.load import restore

        r = restore(path, list(overrides))
        cfg, model, run_dir, mesh = r.cfg, r.model(), resolve(path)[0], r.mesh
        _check_generates(cfg, path)
    tok = make_tokenizer(cfg.data)
    stops = {tok.eos_id} if tok.eos_id is not None else set()
    stops |= generation_stop_ids(generation_config(cfg.data.tokenizer, run_dir))
    bos = [tok.bos_id] if cfg.data.add_bos and tok.bos_id is not None else []
    return Loaded(model, tok, stops, bos, mesh, cfg.mesh)


def load(path, overrides=()):
    """(model, tokenizer, stop ids, bos ids) of a run directory or a Hugging Face directory."""
    r = load_run(path, overrides)
    return r.model, r.tok, r.stops, r.bos


def build(
    model,
    tok,
    stops,
    bos,
    name: str,
    *,
    api_key=None,
    precompile=False,
    precompile_scoring=False,
    media=None,
    **engine_kw,
):
    """(FastAPI app, worker) serving `model`; the worker is started by the app's lifespan.
    `precompile`: compile every step bucket first (`engine.precompile`); `precompile_scoring`:
    every bucket's prompt log-probabilities program too; `media`: the directory
    chat image parts may read local files under (None: data URLs only)."""
    import contextlib

    from jaxllm.infer.chat import end_of_turn
    from jaxllm.infer.engine import Engine
    from jaxllm.serve.app import Served, make_app
    from jaxllm.serve.worker import EngineWorker

    if engine_kw.get("num_pages") is None:
        per_seq = -(-model.cfg.max_seq_len // engine_kw.get("page_size", 16))
        engine_kw["num_pages"] = engine_kw.get("max_num_seqs", 8) * per_seq + 1
    try:
        engine = Engine(model, tokenizer=tok, **engine_kw)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if precompile or precompile_scoring:
        from jaxllm.infer.engine.precompile import compile_buckets

        compile_buckets(engine, sampling=precompile, prompt_logprobs=precompile_scoring)
    worker = EngineWorker(engine)
    eot = end_of_turn(tok, sorted(stops))
    media = None if media is None else Path(media).resolve()
    served = Served(worker, tok, name, stops, eot, bos, model.cfg.vision, media)
    app = make_app(served, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        worker.start()
        yield
        worker.stop()

    app.router.lifespan_context = lifespan
    return app, worker


ENGINE_KEYS = {
    "swap": str,
    "kv_cache_dtype": str,
    "max_num_seqs": int,
    "page_size": int,
    "kv_group": int,
    "num_pages": int,
    "chunk_size": int,
}
"""The engine flags that `engine.KEY=VALUE` overrides set too (`engine.swap=host`)."""


def engine_overrides(ns: argparse.Namespace, overrides: list[str]) -> list[str]:
    """Sets the `engine.KEY=VALUE` overrides on `ns` (as their flags would); returns the rest,
    the model's."""
    rest = []
    for o in overrides:
        key, _, value = o.partition("=")
        if not key.startswith("engine."):
            rest.append(o)
            continue
        name = key.removeprefix("engine.")
        if name not in ENGINE_KEYS:
            raise ConfigError(f"{key}: unknown engine key; expected one of {sorted(ENGINE_KEYS)}.")
        try:
            setattr(ns, name, ENGINE_KEYS[name](value))
        except ValueError:
            raise ConfigError(f"{o}: {key} takes an integer.") from None
    return rest


def _check_address(host: str, port: int) -> None:
    """A port out of range, a host that is not this machine's, or an address already in use is
    one ConfigError, before the model is loaded."""
    if not 0 < port < 65536:
        raise ConfigError(f"--port {port}: give a port from 1 to 65535.")
    try:
        family, kind, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(
            f"--host {host}: {e.strerror}; give an address of this machine."
        ) from None
    with socket.socket(family, kind) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as e:
            fix = "give a free --port" if e.errno == errno.EADDRINUSE else "check --host"
            raise ConfigError(
                f"--host {host} --port {port}: cannot listen there ({e.strerror}); {fix}."
            ) from None


def cmd_serve(ns: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("jaxllm serve needs FastAPI and uvicorn: pip install 'jaxllm[serve]'")
    path, overrides = split_args(ns.args)
    overrides = engine_overrides(ns, overrides)
    if path is None:
        raise ConfigError("jaxllm serve needs a run directory or a Hugging Face directory.")
    for flag in ("max_num_seqs", "page_size", "kv_group", "chunk_size", "num_pages"):
        if getattr(ns, flag) is not None and getattr(ns, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1.")
    for flag in ("api_key", "served_model_name"):  # an empty key would serve with no key
        if getattr(ns, flag) is not None and not getattr(ns, flag).strip():
            raise ConfigError(f"--{flag.replace('_', '-')} is empty; give one or leave it out.")
    _check_address(ns.host, ns.port)
    media = ns.allowed_local_media_path
    if media is not None and not Path(media).is_dir():
        raise ConfigError(f"--allowed-local-media-path {media}: not a directory; give one.")
    kivi = ns.kv_cache_dtype in ("int4", "int2")
    if ns.page_size is None:
        ns.page_size = ns.kv_group if kivi else 16
    r = load_run(path, overrides)
    app, _ = build(
        r.model,
        r.tok,
        r.stops,
        r.bos,
        ns.served_model_name or Path(path).resolve().name,
        api_key=ns.api_key,
        precompile=ns.precompile,
        precompile_scoring=ns.precompile_scoring,
        media=ns.allowed_local_media_path,
        mesh=r.mesh,
        mesh_config=r.mesh_config,
        max_num_seqs=ns.max_num_seqs,
        page_size=ns.page_size,
        num_pages=ns.num_pages,
        chunk_size=ns.chunk_size,
        kv_cache_dtype=ns.kv_cache_dtype,
        **({"kv_group": ns.kv_group} if kivi else {}),
        swap=ns.swap,
    )
    config = uvicorn.Config(
        app, host=ns.host, port=ns.port, log_level="warning", timeout_graceful_shutdown=5
    )
    # uvicorn raises the signal it caught again once it has shut down: handled here, the
    # process then returns 0 instead of dying by it.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.Server(config).run()
    return 0
