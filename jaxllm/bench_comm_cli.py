"""`jaxllm bench comm [CONFIG.yaml] [key=value ...]`: the collectives' bandwidth over each axis
of the run's mesh (`jaxllm.bench_comm`), in one process or in each process of a group."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxllm import config


def cmd_bench_comm(ns) -> int:
    from jaxllm import distributed

    group = distributed.settings(ns.coordinator, ns.num_processes, ns.process_id)
    cfg = config.load_args(ns.args)
    from jaxllm import bench_comm

    ops = bench_comm.parse_ops(ns.ops)
    lo = bench_comm.parse_size(ns.min_bytes, "--min-bytes")
    hi = bench_comm.parse_size(ns.max_bytes, "--max-bytes")
    bench_comm.sizes(lo, hi)  # sizes out of order: said before any device starts
    bench_comm.check_options(ns.dtype, ns.iters, ns.warmup)
    distributed.initialize(group)
    import jax

    from jaxllm import sharding

    mesh = sharding.make_mesh(cfg.mesh, jax.devices())
    result = bench_comm.bench_comm(mesh, ops, lo, hi, ns.iters, ns.warmup, ns.dtype)
    if jax.process_index() == 0:
        print(bench_comm.format_result(result))
        if ns.json is not None:
            Path(ns.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def add_bench_comm_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Adds `bench comm` to the subparsers of `bench`."""
    b = bench_subparsers.add_parser(
        "comm", help="all-reduce, all-gather, ... bandwidth over each mesh axis (nccl-tests)"
    )
    b.add_argument("args", nargs="*", metavar="CONFIG|key=value")
    ops = "comma-separated collectives (default all): all_reduce,all_gather,reduce_scatter,"
    b.add_argument("--ops", default="all", help=ops + "all_to_all,ppermute")
    b.add_argument("--min-bytes", default="1K", help="smallest buffer per device (default 1K)")
    b.add_argument("--max-bytes", default="16M", help="largest, doubling up to it (default 16M)")
    b.add_argument("--iters", type=int, default=20, help="timed calls per size (median shown)")
    b.add_argument("--warmup", type=int, default=5, help="untimed calls after compiling")
    b.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16, int32")
    b.add_argument("--json", metavar="FILE", help="also write the results here as JSON")
    b.add_argument("--coordinator", help="host:port of process 0, for multi-process runs")
    b.add_argument("--num-processes", type=int, help="processes in the group")
    b.add_argument("--process-id", type=int, help="this process's index, 0-based")
    b.set_defaults(func=cmd_bench_comm)
    return b
