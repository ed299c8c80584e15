"""model.remat=dots_attention on a GPU: the attention forwards in the compiled train step.

Compiles the Llama-3.2-1B train step (seq 4096, batch 4, abstract inputs: nothing is run)
under `dots` and `dots_attention` and counts the attention forward calls in each (cuDNN's
fused-attention custom calls, forward only) with the step's memory; then what
`model.remat=auto` takes at `train.memory_budget` of the device. Under `dots` the layer scan's
backward holds a second forward call (the recompute); under `dots_attention` it must not.
Exit 1 when dots_attention still recomputes.

    JAX_PLATFORMS=cuda python scripts/gpu/remat_attention_count.py [OVERRIDES...]
"""

from __future__ import annotations

import re
import sys

import jax

from jaxllm import config, sharding
from jaxllm.train import remat_auto
from jaxllm.train.compiled import compile_steps

RUN = [
    "data.seq_len=4096",
    "train.global_batch_size=4",
    "model.attention_impl=cudnn",
    "mesh.data=1",
    "mesh.fsdp=-1",
]


def forward_calls(cfg, mesh) -> tuple[int, int]:
    """(cuDNN attention forward custom calls, bytes per device) of the compiled train step."""
    jit_train, _, tx, shardings, batch_sh = compile_steps(cfg, mesh)
    state, batch = remat_auto.abstract_inputs(cfg, mesh, tx, shardings, batch_sh)
    compiled = jit_train.lower(state, batch).compile()
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', compiled.as_text())
    return sum("Backward" not in c for c in calls), remat_auto.memory(compiled)["total"]


def main(argv) -> int:
    cfg = config.load("configs/models/llama3_2_1b.yaml", [*RUN, *argv])
    devices = jax.devices()
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    counts = {}
    for remat in ("dots", "dots_attention"):
        counts[remat], total = forward_calls(remat_auto.with_remat(cfg, remat), mesh)
        print(f"remat={remat}: {counts[remat]} attention forward calls, {total / 2**30:.2f} GiB")
    auto = config.load("configs/models/llama3_2_1b.yaml", [*RUN, *argv, "model.remat=auto"])
    remat_auto.resolve(auto, mesh)
    return 0 if counts["dots_attention"] < counts["dots"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
