"""Which base a fine-tuning run's adapters belong to.

Adapters (or a soft prompt) mean nothing without the exact weights they were trained on, and
their checkpoints do not hold those weights: a PEFT run records its base in every checkpoint
(the JSON item `base`) as the path it loaded and a SHA-256 of that path's weight files, or as
the seed of a randomly initialised base. Resuming, evaluating or loading the run loads the base
again from there, and refuses, in one line, a base whose content is not the recorded one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import jax
import optax

from jaxllm import checkpoint, config
from jaxllm.config import Config, RunError
from jaxllm.convert import is_hf_dir

BASE_ITEM = "base"


def _weight_files(source: Path) -> tuple[Path, list[Path]]:
    """(the path to load, the files whose bytes are the base): a Hugging Face directory's
    config.json and safetensors, or the parameters of one jaxllm checkpoint step (the newest
    with parameters when `source` is a run or checkpoints directory)."""
    if is_hf_dir(source):
        files = sorted(source.glob("*.safetensors")) + [source / "config.json"]
        return source, files
    from jaxllm.load import resolve  # jaxllm.load imports this package's users

    run_dir, ckpt_dir, step = resolve(source)
    if step is None:
        saved = config.load(run_dir / "config.yaml")
        ckpt_dir = ckpt_dir or checkpoint.checkpoint_dir(run_dir, saved.checkpoint.dir)
        with_params = [
            s for s in checkpoint.steps(ckpt_dir) if (ckpt_dir / str(s) / "params").is_dir()
        ]
        if not with_params:
            raise RunError(f"checkpoint.init_from={source} holds no checkpoint with parameters.")
        source = ckpt_dir / str(with_params[-1])
    files = sorted(p for p in (source / "params").rglob("*") if p.is_file())
    return source, files


def content_hash(files: list[Path], root: Path) -> str:
    """SHA-256 over the files' paths (relative to `root`) and bytes, in order."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def base_record(cfg: Config) -> dict | None:
    """What this run's base is (None without peft): {"source", "sha256"} for
    `checkpoint.init_from` (a run or checkpoints directory resolved to its newest step), else
    {"seed"}: the random initialisation of `run.seed`."""
    if cfg.peft.method == "none":
        return None
    if not cfg.checkpoint.init_from:
        return {"seed": cfg.run.seed}
    source, files = _weight_files(Path(cfg.checkpoint.init_from).resolve())
    return {"source": str(source), "sha256": content_hash(files, source)}


def check_base(recorded: dict | None, current: dict | None) -> None:
    """RunError when a run's checkpoints were trained on another base than `current`."""
    if not recorded or recorded == current:
        return
    if current and recorded.get("sha256") and recorded.get("sha256") == current.get("sha256"):
        return  # the same weights, found at another path
    raise RunError(
        f"this run's adapters were trained on the base {_describe(recorded)}, but "
        f"checkpoint.init_from gives {_describe(current)}; point checkpoint.init_from at the "
        "run's base, or start a new run.dir."
    )


def _describe(record: dict | None) -> str:
    if not record:
        return "none"
    if "seed" in record:
        return f"initialised randomly with run.seed={record['seed']}"
    return f"{record['source']} (sha256 {record['sha256'][:12]})"


def load_frozen(cfg: Config, mesh, record: dict, *, verify: bool = False):
    """The frozen base of a PEFT run from its `record`, in its shards on `mesh`; with `verify`,
    RunError when the recorded path no longer holds the recorded weights."""
    from jaxllm.load import load_weights
    from jaxllm.model import abstract_frozen, lora
    from jaxllm.train.state import _init, frozen_shardings

    shardings = frozen_shardings(cfg.model, mesh, cfg.peft)
    if "seed" in record:
        init = lambda: _init(cfg.model, optax.identity(), record["seed"], None, cfg.peft).frozen  # noqa: E731
        return jax.jit(init, out_shardings=shardings)()
    if verify:
        source, files = _weight_files(Path(record["source"]))
        check_base(record, {"source": str(source), "sha256": content_hash(files, source)})
    params, _ = load_weights(record["source"], cfg.model, mesh)
    axes = abstract_frozen(cfg.model, cfg.peft)[1]
    return jax.jit(lambda p: lora.freeze(p, axes, cfg.peft), out_shardings=shardings)(params)


def imported_adapters(ckpt_dir: Path, target, base: dict | None):
    """The adapters a PEFT run starts from when its own directory holds a weights-only
    checkpoint of them with a base record (`jaxllm convert import --peft`), restored into
    `target` (their abstract arrays with shardings, `jaxllm.load.weight_targets`); None
    otherwise (they start fresh). RunError when that checkpoint's base is not `base`."""
    found = checkpoint.steps(ckpt_dir)
    if base is None or not found or checkpoint.has_train_state(ckpt_dir, found[-1]):
        return None
    recorded = checkpoint.read_json_item(ckpt_dir, found[-1], BASE_ITEM)
    if recorded is None:  # an imported base (`jaxllm convert import`), not adapters
        return None
    check_base(recorded, base)
    return checkpoint.restore_weights(ckpt_dir, target, step=found[-1]).params
