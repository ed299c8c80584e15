"""Serving benchmark: `jaxllm serve` under N concurrent streaming clients, against the static-batch
generator and Hugging Face transformers' `generate` on the same requests, in one run.

    python scripts/bench_serve.py RUN_DIR [--clients 16] [--num-requests 64]
        [--output-len 16:512] [--prompt-len 16:64] [--system-prompt 200] [--max-model-len N]
        [--out bench.json]

Requests come from a seeded RNG: a shared system prompt of K random tokens (0: none), then a
user prompt of U[a, b] random tokens; each asks for U[lo, hi] new tokens, made exact with
`ignore_eos` (greedy). The prompts go as token ids, so no tokenizer sits between the runs.

- serve: `jaxllm serve RUN_DIR --precompile` in a subprocess on 127.0.0.1 (or `--url` of a
  running one), warmed up (one request per prefill bucket, own tokens), then N clients,
  each sending its next request as soon as its last one ends (a closed loop), all streaming
  /v1/completions. Requests/s and output tokens/s over the wall time from the first send to the
  last end; time to first token (send to the first streamed text) and inter-token latency (the
  gaps between streamed texts) percentiles; the server's own counts from /metrics: generated
  tokens (checked against the requested ones) and the prefix-cache hit rate where it has one.
- static: `jaxllm.infer.generate.generate` on batches of N requests in arrival order, each
  batch decoding until its longest request's max_tokens, as a static-batch server does; output
  tokens/s counts only the requested tokens. Each batch runs twice, the second timed (the
  first compiles its shapes; the server was warmed up too).
- hf: the run exported by `jaxllm convert export` in transformers (torch, float32, CPU, one
  thread: on the shared 2-core CPU two ran 8x slower), its `generate` (greedy, left-padded,
  exactly the batch's longest max_tokens) on the same batches after an untimed warm-up.

One table goes to stdout and everything to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from jaxllm.bench import device_description, script_main
from jaxllm.config import ConfigError


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO:HI (two integers)") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return lo, hi


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one `jaxllm: ...` line, exit 2, as every jaxllm command
        raise ConfigError(message)


def parse_args(argv=None) -> argparse.Namespace:
    ap = _Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="the run to serve, and to run statically")
    ap.add_argument("--url", help="a running `jaxllm serve` of RUN_DIR (default: start one)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (and batch size)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=_range, default=(16, 512), help="LO:HI new tokens")
    ap.add_argument("--prompt-len", type=_range, default=(16, 64), help="LO:HI user tokens")
    ap.add_argument("--system-prompt", type=int, default=200, help="shared prompt tokens (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=0, help="serve with model.max_seq_len=N")
    ap.add_argument("--kv-cache-dtype", default="float32", choices=("bfloat16", "float32", "int8"))
    ap.add_argument("--no-static", action="store_true", help="leave out the static generator")
    ap.add_argument("--no-hf", action="store_true", help="leave out transformers' generate")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch's (0: its default)")
    ap.add_argument("--out", type=Path, help="write the results here (JSON)")
    ns = ap.parse_args(argv)
    for flag in ("clients", "num_requests", "page_size", "chunk_size"):
        if getattr(ns, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1.")
    if ns.system_prompt < 0:
        raise ConfigError("--system-prompt must be 0 or more tokens.")
    return ns


def make_requests(ns, vocab: int, specials) -> tuple[list[dict], list[int]]:
    """The seeded requests ({"prompt": ids, "max_tokens": n}) and warm-up tokens."""
    rng = np.random.default_rng(ns.seed)
    pool = np.array([t for t in range(vocab) if t not in specials])
    draw = lambda n: pool[rng.integers(0, len(pool), n)].tolist()  # noqa: E731
    system, warm = draw(ns.system_prompt), draw(ns.system_prompt + 2 * ns.chunk_size + 2)
    reqs = []
    for _ in range(ns.num_requests):
        user = draw(int(rng.integers(ns.prompt_len[0], ns.prompt_len[1] + 1)))
        out = int(rng.integers(ns.output_len[0], ns.output_len[1] + 1))
        reqs.append({"prompt": system + user, "max_tokens": out})
    return reqs, warm


def pct(xs) -> dict:
    """p50 / p90 / p99 and mean of `xs` in milliseconds (None where there is nothing)."""
    if not len(xs):
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(xs) * 1e3
    out = {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}
    return {**out, "mean": float(a.mean())}


# ---------------------------------------------------------------- the server under load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ns, log) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "jaxllm", "serve", str(ns.run_dir), "--port", str(port)]
    cmd += ["--max-num-seqs", str(ns.clients), "--page-size", str(ns.page_size), "--precompile"]
    cmd += ["--chunk-size", str(ns.chunk_size), "--kv-cache-dtype", ns.kv_cache_dtype]
    # vLLM's --max-model-len: serve with a shorter model.max_seq_len (fewer step buckets)
    cmd += [f"model.max_seq_len={ns.max_model_len}"] if ns.max_model_len else []
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    while time.time() - t0 < 600:
        if proc.poll() is not None:
            log.seek(0)
            raise ConfigError(f"jaxllm serve exited {proc.returncode}: {log.read()[-2000:]!r}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise ConfigError("jaxllm serve did not answer /health within 600 s.")


def read_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#"):
            out[parts[0]] = float(parts[1])
    return out


def prefix_hit_rate(before: dict, after: dict) -> tuple[float | None, dict]:
    """The server's prefix-cache hit rate over the run: from hit / query counters (their
    deltas) where /metrics has them, else its hit-rate gauge; None where it reports neither."""
    keys = {k: (before.get(k), after[k]) for k in after if "prefix" in k}
    delta = {
        k.removesuffix("_total").rsplit("_", 1)[-1]: after[k] - (before.get(k) or 0.0)
        for k in keys
        if k.endswith(("cache_hits_total", "cache_queries_total"))
    }
    if delta.get("queries"):
        return delta.get("hits", 0.0) / delta["queries"], keys
    rate = [k for k in keys if "hit_rate" in k]
    return (after[rate[0]] if rate else None), keys


async def _one(client, url, model, req, rec) -> None:
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"]}
    body |= {"temperature": 0, "stream": True, "ignore_eos": True}
    rec["sent"], rec["chunks"], rec["finish"] = time.perf_counter(), [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise ConfigError(f"the server answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            rec["finish"] = choice.get("finish_reason") or rec["finish"]
            # tokens that end mid-character come with the next text: the chunks with text
            # (or the last one, where none had text) are what a client sees arrive
            if choice.get("text") or (rec["finish"] and not rec["chunks"]):
                rec["chunks"].append(time.perf_counter())
    rec["end"] = time.perf_counter()


async def _drive(url, model, reqs, clients) -> tuple[list[dict], float]:
    """Runs `reqs` through `clients` closed-loop clients; (one record per request, wall s)."""
    recs = [{} for _ in reqs]
    queue = list(range(len(reqs)))[::-1]
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:

        async def worker():
            while queue:
                i = queue.pop()
                await _one(client, url, model, reqs[i], recs[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return recs, time.perf_counter() - t0


def warm_up(url, model, ns, warm_tokens) -> None:
    """Compiles the server's step for each prefill bucket (1, 2, 4 .. chunk_size) and a full
    batch, with random tokens that share no prefix page with the measured requests."""
    lengths = [1] + [2**k + 1 for k in range(ns.chunk_size.bit_length())]
    for length in lengths:  # one at a time: a prompt of 2^k + 1 tokens feeds bucket 2^k + 1
        req = {"prompt": warm_tokens[:length], "max_tokens": 3}
        asyncio.run(_drive(url, model, [req], 1))
    n = len(warm_tokens)
    full = [{"prompt": warm_tokens[i % n :], "max_tokens": 4} for i in range(ns.clients)]
    asyncio.run(_drive(url, model, full, ns.clients))


def bench_serve(ns, reqs, warm_tokens) -> dict:
    proc, log = None, tempfile.TemporaryFile("w+")
    try:
        url = ns.url
        if url is None:
            proc, url = start_server(ns, log)
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        t0 = time.perf_counter()
        warm_up(url, model, ns, warm_tokens)
        warm_s = time.perf_counter() - t0
        before = read_metrics(url)
        recs, wall = asyncio.run(_drive(url, model, reqs, ns.clients))
        after = read_metrics(url)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
    wanted = sum(r["max_tokens"] for r in reqs)
    ttft = [r["chunks"][0] - r["sent"] for r in recs if r["chunks"]]
    itl = [b - a for r in recs for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [  # time per output token after the first, per request
        (r["end"] - r["chunks"][0]) / (q["max_tokens"] - 1)
        for r, q in zip(recs, reqs)
        if q["max_tokens"] > 1 and r["chunks"]
    ]
    gen_key = "jaxllm_generation_tokens_total"
    rate, prefix = prefix_hit_rate(before, after)
    return {
        "requests_per_s": len(reqs) / wall,
        "output_tokens_per_s": wanted / wall,
        "wall_s": wall,
        "warmup_s": warm_s,
        "output_tokens": wanted,
        "server_generated_tokens": after.get(gen_key, 0.0) - before.get(gen_key, 0.0),
        "finished_by_length": sum(r["finish"] == "length" for r in recs),
        "streamed_chunks": sum(len(r["chunks"]) for r in recs),
        "ttft_ms": pct(ttft),
        "itl_ms": pct(itl),
        "tpot_ms": pct(tpot),
        "latency_ms": pct([r["end"] - r["sent"] for r in recs]),
        "prefix_cache_hit_rate": rate,
        "prefix_metrics": prefix,
        "preemptions": after.get("jaxllm_preemptions_total", 0.0)
        - before.get("jaxllm_preemptions_total", 0.0),
    }


# ---------------------------------------------------------------- static batches


def _batches(reqs, size):  # static batches: arrival order
    return [reqs[i : i + size] for i in range(0, len(reqs), size)]


def _static_result(reqs, times, generated, extra) -> dict:
    wall, wanted = sum(times), sum(r["max_tokens"] for r in reqs)
    return {
        "requests_per_s": len(reqs) / wall,
        "output_tokens_per_s": wanted / wall,
        "wall_s": wall,
        "output_tokens": wanted,
        "generated_tokens": generated,
        "batch_s": times,
        **extra,
    }


def bench_static(ns, reqs) -> dict:
    from jaxllm.config import GenerateConfig
    from jaxllm.infer.generate import generate
    from jaxllm.serve.cli import load

    model = load(ns.run_dir)[0]
    times, first, generated = [], [], 0
    for batch in _batches(reqs, ns.clients):
        longest = max(r["max_tokens"] for r in batch)
        gen = GenerateConfig(
            max_new_tokens=longest, temperature=0.0, kv_cache_dtype=ns.kv_cache_dtype
        )
        prompts = [r["prompt"] for r in batch]
        for timed in (False, True):  # no stop tokens: every row decodes `longest` tokens
            t0 = time.perf_counter()
            out = generate(model, prompts, gen)
            (times if timed else first).append(time.perf_counter() - t0)
        assert all(len(t) == longest for t in out.tokens), "a static row stopped early"
        generated += len(batch) * longest
    return _static_result(reqs, times, generated, {"first_call_s": first})


def bench_hf(ns, reqs) -> dict:
    import torch
    import transformers

    from jaxllm.cli import main as jaxllm_main

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        with contextlib.redirect_stdout(sys.stderr):  # its report: not part of the table
            code = jaxllm_main(["convert", "export", str(ns.run_dir), str(hf_dir)])
        if code != 0:
            raise ConfigError(f"jaxllm convert export {ns.run_dir} failed")
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    if ns.torch_threads > 0:
        torch.set_num_threads(ns.torch_threads)

    def run(batch, new: int):
        width = max(len(r["prompt"]) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left-padded, as decoder-only generation needs
            ids[i, width - len(r["prompt"]) :] = torch.tensor(r["prompt"])
            mask[i, width - len(r["prompt"]) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        return out.shape[1] - width

    run(reqs[:2], 2)  # warm-up
    times, generated = [], 0
    for batch in _batches(reqs, ns.clients):
        longest = max(r["max_tokens"] for r in batch)
        t0 = time.perf_counter()
        got = run(batch, longest)
        times.append(time.perf_counter() - t0)
        assert got == longest, f"transformers made {got} tokens, not {longest}"
        generated += len(batch) * longest
    extra = {"torch": torch.__version__, "transformers": transformers.__version__}
    return _static_result(reqs, times, generated, {**extra, "threads": torch.get_num_threads()})


def _ms(p: dict) -> str:
    if p["p50"] is None:
        return "—"
    return f"{p['p50']:.0f} / {p['p90']:.0f} / {p['p99']:.0f}"


def table(res: dict) -> str:
    rows = [
        "| system | requests/s | output tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | "
        "wall s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    names = {"serve": "jaxllm serve", "static": "static generate", "hf": "HF generate"}
    for key, name in names.items():
        r = res.get(key)
        if r is None:
            continue
        lat = (_ms(r["ttft_ms"]), _ms(r["itl_ms"])) if key == "serve" else ("—", "—")
        rows.append(
            f"| {name} | {r['requests_per_s']:.3f} | {r['output_tokens_per_s']:.1f} | "
            f"{lat[0]} | {lat[1]} | {r['wall_s']:.1f} |"
        )
    lines = ["\n".join(rows)]
    for key in ("static", "hf"):
        if key in res:
            lines.append(f"serve / {key} output tokens/s: {res[f'speedup_vs_{key}']:.2f}x")
    rate = res["serve"]["prefix_cache_hit_rate"]
    rate = "not reported" if rate is None else f"{rate:.3f}"
    bound = res["prefix_cache_hit_rate_bound"]
    lines.append(f"prefix-cache hit rate: {rate} (all system-prompt pages hit: {bound:.3f})")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ns = parse_args(argv)
    from jaxllm.config import load as load_config
    from jaxllm.data.tokenizer import make_tokenizer

    if not (ns.run_dir / "config.yaml").is_file():
        raise ConfigError(f"{ns.run_dir} is not a run directory (no config.yaml).")
    cfg = load_config(ns.run_dir / "config.yaml")
    tok = make_tokenizer(cfg.data)
    longest = ns.system_prompt + ns.prompt_len[1] + ns.output_len[1]
    if longest > (ns.max_model_len or cfg.model.max_seq_len):
        raise ConfigError(
            f"--system-prompt + --prompt-len HI + --output-len HI is {longest} tokens, over "
            f"the model's max_seq_len ({ns.max_model_len or cfg.model.max_seq_len})."
        )
    specials = {tok.eos_id, tok.bos_id, getattr(tok, "pad_id", None)}
    reqs, warm_tokens = make_requests(ns, cfg.model.vocab_size, specials)
    prompt_tokens = sum(len(r["prompt"]) for r in reqs)
    shared = ns.system_prompt // ns.page_size * ns.page_size
    res = {
        "command": "python scripts/bench_serve.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items() if k != "out"
        },
        "prompt_tokens": prompt_tokens,
        # the hit rate were every request to find the system prompt's full pages cached
        "prefix_cache_hit_rate_bound": shared * len(reqs) / prompt_tokens,
    }
    phases = [("serve", bench_serve, (warm_tokens,))]
    phases += [] if ns.no_static else [("static", bench_static, ())]
    phases += [] if ns.no_hf else [("hf", bench_hf, ())]
    for name, fn, extra in phases:
        t0 = time.perf_counter()
        res[name] = fn(ns, reqs, *extra)
        print(f"bench_serve: {name} took {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    # asked after the server's process has ended: this process then holds the device alone
    res["device"] = device_description()
    serve_tps = res["serve"]["output_tokens_per_s"]
    for key in [k for k in ("static", "hf") if k in res]:
        res[f"speedup_vs_{key}"] = serve_tps / res[key]["output_tokens_per_s"]
    print(table(res))
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    script_main(main)
