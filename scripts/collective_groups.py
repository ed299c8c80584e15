"""The collectives of a `jaxllm plan` compile by kind and device-group size, as the HLO has them
(before `plan`'s reduce-scatter counting): which mesh axes the bytes cross.

    python scripts/collective_groups.py configs/models/llama3_1_8b.yaml mesh.data=1 mesh.tensor=4 \
        mesh.tensor2=2

Runs on 8 simulated CPU devices; a group size of 8 is `replica_groups={}` (every device).
"""

from __future__ import annotations

import os
import re
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxllm import config, plan  # noqa: E402
from jaxllm.hlo_collectives import DTYPE_BYTES, collectives  # noqa: E402

_OP = re.compile(r"= (.*?) (all-reduce|all-gather|reduce-scatter)(?:-start)?\(")


def group_table(hlo: str, devices: int) -> dict[tuple[str, int], tuple[int, int]]:
    """(kind, group size) -> (ops, result bytes) of the collectives in `hlo`."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for line in hlo.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        if g := re.search(r"replica_groups=\[(\d+),(\d+)\]", line):
            size = int(g.group(2))
        elif g := re.search(r"replica_groups=\{\{([\d,]+)\}", line):
            size = len(g.group(1).split(","))
        else:
            size = devices
        nbytes = 0
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            nbytes += n * DTYPE_BYTES.get(dtype, 0)
        ops, total = out.get((m.group(2), size), (0, 0))
        out[(m.group(2), size)] = (ops + 1, total + nbytes)
    return out


def main(args: list[str]) -> None:
    seen = {}

    def keep(text):
        seen["hlo"] = text
        return collectives(text)

    plan.collectives = keep
    report = plan.plan(config.load_args(args), jax.devices())
    print("plan's table:", report["collectives"])
    for (kind, size), (ops, nbytes) in sorted(group_table(seen["hlo"], 8).items()):
        print(f"  {kind:15s} groups of {size}: {ops:3d} ops {nbytes / 2**20:10.2f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
