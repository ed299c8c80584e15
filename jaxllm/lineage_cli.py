"""`jaxllm lineage A B`: whether B descends from A's initialisation (`jaxllm.lineage`,
SeedPrints). Exit 0 either way; the verdict is the first line (and `descends` in --json)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from jaxllm.config import ConfigError


def cmd_lineage(ns) -> int:
    if not (0.0 < ns.alpha < 1.0) or not math.isfinite(ns.alpha):
        raise ConfigError(f"--alpha must lie between 0 and 1, not {ns.alpha}.")
    for flag, value in (("--probes", ns.probes), ("--length", ns.length)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, not {value}.")
    for path in (ns.a, ns.b):
        if not Path(path).exists():
            raise ConfigError(f"{path} does not exist.")
    from jaxllm import lineage

    r = lineage.lineage(
        ns.a, ns.b, probes=ns.probes, length=ns.length, probe_seed=ns.probe_seed,
        alpha=ns.alpha, reference=ns.reference,
    )  # fmt: skip
    print(lineage.format_result(r))
    if ns.json is not None:
        Path(ns.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


def add_lineage_parser(sub) -> argparse.ArgumentParser:
    """Adds `lineage` to the command's subparsers."""
    p = sub.add_parser(
        "lineage", help="does B descend from A's initialisation? (SeedPrints, output biases)"
    )
    p.add_argument("a", metavar="RUN_OR_HF_A", help="the ancestor: a run, checkpoint or HF dir")
    p.add_argument("b", metavar="RUN_OR_HF_B", help="the model to test, of the same shape")
    ref = "A's side: its init rebuilt from its seed (a run's run.seed), or its weights; auto "
    p.add_argument("--reference", choices=("auto", "init", "weights"), default="auto",
                   help=ref + "(default) takes the init where it can")  # fmt: skip
    p.add_argument("--alpha", type=float, default=1e-3, help="significance level (default 1e-3)")
    p.add_argument("--probes", type=int, default=64, help="random probe sequences (default 64)")
    p.add_argument("--length", type=int, default=32, help="tokens per probe (default 32)")
    p.add_argument("--probe-seed", type=int, default=0, help="seed of the probes (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write the result here as JSON")
    p.set_defaults(func=cmd_lineage)
    return p
