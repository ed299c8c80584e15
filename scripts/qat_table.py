"""QAT against post-training quantization for the same steps: from one trained run, train
STEPS more steps in float, with QAT at int4 and MXFP4, and with QAT + distillation from the
starting run; quantize the float continuation by RTN int4, GPTQ int4 and MXFP4; evaluate every
result on the held-out split (the QAT runs evaluate as quantized, which is what their
`jaxllm quantize` computes: tests/test_qat.py).

    python scripts/qat_table.py RUN [--steps 50] [--lr 3e-4] [--workdir DIR] [--out FILE.json]
        [--calibration PATH] [--samples 128] [--eval-batches 16]

Prints a markdown table: the kind, the method, held-out NLL and perplexity, and the perplexity
against the float continuation's (what training on the data for STEPS more steps reaches) and
against the starting run's (what distillation from it aims at: its loss is the KL to the
starting run alone, `train.distill_weight=1`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax

from jaxllm.cli import main as jaxllm_main
from jaxllm.evaluate import evaluate_checkpoint


def _train(run: Path, out: Path, ns, *extra: str) -> Path:
    if not (out / "checkpoints").exists():
        argv = ["train", str(run / "config.yaml"), f"checkpoint.init_from={run}"]
        argv += [f"train.steps={ns.steps}", f"optim.lr={ns.lr}", "optim.warmup_steps=0"]
        argv += ["train.eval_every=0", "train.sample_tokens=0", f"run.dir={out}"]
        assert jaxllm_main([*argv, *extra]) == 0
    return out


def _quantize(src: Path, out: Path, ns, method: str, *extra: str) -> Path:
    if not out.exists():
        how = ["--samples", str(ns.samples)] if method == "gptq" else []
        if method == "gptq" and ns.calibration:
            how += ["--calibration", ns.calibration]
        assert jaxllm_main(["quantize", str(src), str(out), "--method", method, *how, *extra]) == 0
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--calibration")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=16)
    ns = p.parse_args(argv)
    run = ns.run.resolve()
    work = (ns.workdir or run.parent / f"{run.name}-qat").resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fl = _train(run, work / "float", ns)
    int4 = ["train.qat.weights=int4"]
    distill = ["train.objective=distill", f"train.teacher={run}"]
    rows = [
        ("float", "starting run (the teacher)", run),
        ("float", "float continuation", fl),
        ("int4", "PTQ RTN", _quantize(fl, work / "float-rtn4", ns, "rtn", "--bits", "4")),
        ("int4", "PTQ GPTQ", _quantize(fl, work / "float-gptq4", ns, "gptq", "--bits", "4")),
        ("int4", "QAT", _train(run, work / "qat-int4", ns, *int4)),
        ("int4", "QAT + distillation", _train(run, work / "qatd-int4", ns, *int4, *distill)),
        ("mxfp4", "PTQ RTN", _quantize(fl, work / "float-mxfp4", ns, "mxfp4")),
        ("mxfp4", "QAT", _train(run, work / "qat-mxfp4", ns, "train.qat.weights=mxfp4")),
        (
            "mxfp4",
            "QAT + distillation",
            _train(run, work / "qatd-mxfp4", ns, "train.qat.weights=mxfp4", *distill),
        ),
    ]
    results = {
        "run": str(run),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "jax": jax.__version__,
        "settings": {k: str(v) for k, v in vars(ns).items()},
        "rows": [],
    }
    for kind, method, path in rows:
        ev = evaluate_checkpoint(path, num_batches=ns.eval_batches)
        # a distilled run's eval loss is its distillation loss: its NLL is the data's loss
        nll = ev.get("eval_nll", ev["eval_loss"])
        results["rows"].append({"kind": kind, "method": method, "nll": nll, "run": str(path)})
        print(f"{kind} {method}: {nll:.4f}", file=sys.stderr)
    results["seconds"] = time.perf_counter() - t0
    if ns.out:
        ns.out.write_text(json.dumps(results, indent=1) + "\n")
    start, cont = (math.exp(r["nll"]) for r in results["rows"][:2])
    print("| kind | method | held-out NLL | PPL | ΔPPL vs continuation | ΔPPL vs start |")
    print("|---|---|---|---|---|---|")
    for r in results["rows"]:
        ppl = math.exp(r["nll"])
        print(
            f"| {r['kind']} | {r['method']} | {r['nll']:.4f} | {ppl:.3f} | {ppl - cont:+.3f} "
            f"| {ppl - start:+.3f} |"
        )
    return results


if __name__ == "__main__":
    main()
