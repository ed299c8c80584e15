"""Pipeline bubbles: the schedule table's, the textbook formula's, and one measured from step time.

Each case trains a small float32 model (8 layers) pipelined over p simulated CPU devices, one
per stage, and the same model on one device with the same microbatches (gradient
accumulation). With perfect overlap the pipeline step would take T1 / p; the measured
"bubble" is T_p / (T1 / p) - 1, idle per busy time like the formula's (p-1)/m. It includes
what the table does not count: the stage-level recompute of each forward in the backward, the
per-tick permutes and buffer updates, and, with more stages than cores, stages that share one.

    python scripts/pipeline_bubble.py            # writes the markdown table to stdout
    python scripts/pipeline_bubble.py dualpipev  # only the rows of the schedules named
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm import config, sharding  # noqa: E402
from jaxllm.bench import synthetic_batch  # noqa: E402
from jaxllm.parallel import schedules  # noqa: E402
from jaxllm.train.loop import compile_steps, to_global  # noqa: E402
from jaxllm.train.state import init_state, layout  # noqa: E402

STEPS = 5
# Cost of each action in forwards of one chunk for one microbatch: the backward recomputes the
# stage forward from its stored input (BW = F + 2F, B and W = F + F each).
COST = {schedules.IDLE: 0, schedules.F: 1, schedules.B: 2, schedules.W: 2, schedules.BW: 3}


def lock_step(t: schedules.Table) -> float:
    """Predicted Tp / (T1 / p) - 1 of the lock-step executor: each tick lasts as long as its
    slowest stage's action; one device does 3 m (chunks / p) chunk-forwards' work per stage
    share (chunks / p: v, DualPipeV 2, DualPipe 1: its two chunks are one stage twice)."""
    cost = np.vectorize(COST.get)(t.actions[:, :, schedules.ACTION])
    return float(cost.max(axis=1).sum()) / (3 * t.microbatches * t.chunks / t.stages) - 1


def _cfg(p: int, m: int, schedule: str, v: int) -> config.Config:
    mesh = dict(stage=p, data=1)
    if p > 1:
        mesh.update(pipeline_schedule=schedule, virtual_stages=v)
    return config.Config(
        model=config.ModelConfig(
            vocab_size=256,
            d_model=256,
            num_layers=8,
            num_heads=4,
            num_kv_heads=4,
            mlp_dim=1024,
            max_seq_len=128,
            dtype="float32",
            param_dtype="float32",
        ),
        mesh=config.MeshConfig(**mesh),
        data=config.DataConfig(seq_len=128),
        train=config.TrainConfig(global_batch_size=4 * m, steps=STEPS, grad_accum_steps=m),
    )


def step_time(cfg: config.Config, n_devices: int) -> float:
    """Median seconds of a train step after the first (compile) one."""
    devices = jax.devices()[:n_devices]
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    batch = to_global(synthetic_batch(cfg), batch_sh)
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


CASES = [  # (schedule, p, m, v)
    ("gpipe", 2, 4, 1),
    ("1f1b", 2, 4, 1),
    ("interleaved", 2, 4, 2),
    ("zero_bubble", 2, 4, 1),
    ("1f1b", 2, 2, 1),
    ("1f1b", 2, 8, 1),
    ("1f1b", 4, 4, 1),
    ("1f1b", 4, 8, 1),
    ("gpipe", 4, 8, 1),
    ("zero_bubble", 4, 8, 1),
    ("dualpipev", 2, 4, 1),
    ("dualpipev", 4, 8, 1),
    ("dualpipe", 2, 4, 1),
    ("dualpipe", 4, 8, 1),
]


def main() -> None:
    print(
        "| schedule | p | m | v | ticks | table bubble | table idle/busy | formula (idle/busy) "
        "| in-flight per stage | lock-step model | T1 (s) | Tp (s) | measured Tp/(T1/p) - 1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ref: dict[int, float] = {}
    names = sys.argv[1:] or {c[0] for c in CASES}
    for schedule, p, m, v in (c for c in CASES if c[0] in names):
        if m not in ref:
            ref[m] = step_time(_cfg(1, m, "1f1b", 1), 1)
        tp = step_time(_cfg(p, m, schedule, v), p)
        t = schedules.build(schedule, p, m, v)
        measured = tp / (ref[m] / p) - 1
        print(
            f"| {schedule} | {p} | {m} | {t.virtual} | {t.ticks} | {t.bubble:.3f} | {t.bubble_ratio:.3f} "
            f"| {schedules.formula(schedule, p, m, v):.3f} | {list(t.in_flight)} "
            f"| {lock_step(t):.2f} | {ref[m]:.3f} "
            f"| {tp:.3f} | {measured:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
