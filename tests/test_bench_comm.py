"""`jaxllm bench comm`: the collectives over each mesh axis, their nccl-tests bandwidths, the
check of every result, and its mistakes reported as one line."""

import json
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import cpu_env

from jaxllm import bench_comm, config, sharding
from jaxllm.cli import main

ROW = re.compile(
    r"^\s+(\d+)\s+(\d+)\s+(\w+)\s+(sum|none)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$"
)


def _mesh(**degrees) -> jax.sharding.Mesh:
    return sharding.make_mesh(config.MeshConfig(**degrees), jax.devices())


def test_bus_factors_are_nccl_tests():
    # a fake timing: 8 MB in 1 ms is 8 GB/s of algorithm bandwidth, whatever the collective
    n, size, seconds = 4, 8_000_000, 1e-3
    expected = {
        "all_reduce": 8 * 2 * 3 / 4,  # 2(n-1)/n
        "all_gather": 8 * 3 / 4,  # (n-1)/n
        "reduce_scatter": 8 * 3 / 4,
        "all_to_all": 8 * 3 / 4,
        "ppermute": 8.0,  # a send/receive moves all of it
    }
    for op, busbw in expected.items():
        algbw, bus = bench_comm.bandwidths(op, n, size, seconds)
        assert algbw == pytest.approx(8.0)
        assert bus == pytest.approx(busbw), op
    assert bench_comm.bus_factor("all_reduce", 1) == 0  # one device: nothing crosses a link
    assert bench_comm.bus_factor("all_reduce", 2) == 1


def test_sizes_double_from_min_to_max():
    assert bench_comm.sizes(1024, 8192) == [1024, 2048, 4096, 8192]
    assert bench_comm.sizes(1000, 5000) == [1000, 2000, 4000]
    assert bench_comm.sizes(64, 64) == [64]
    assert bench_comm.parse_size("16M", "--max-bytes") == 16 * 2**20
    assert bench_comm.parse_size("1KiB", "--min-bytes") == 1024
    assert bench_comm.parse_size("4096", "--min-bytes") == 4096
    assert bench_comm.parse_ops("all") == bench_comm.OPS
    assert bench_comm.parse_ops("ppermute, all_reduce") == ("ppermute", "all_reduce")


def test_every_collective_over_each_axis_of_a_2x4_mesh():
    mesh = _mesh(data=2, tensor=4)
    result = bench_comm.bench_comm(mesh, min_bytes=256, max_bytes=1024, iters=2, warmup=1)
    rows = result["rows"]
    assert {(r["op"], r["axis"]) for r in rows} == {
        (op, axis) for op in bench_comm.OPS for axis in ("data", "tensor")
    }
    for r in rows:
        assert r["devices"] == {"data": 2, "tensor": 4}[r["axis"]]
        assert r["groups"] == 8 // r["devices"]
        assert r["wrong"] == 0, r
        assert r["count"] * 4 == r["size"] and r["size"] in (256, 512, 1024)
        assert r["time_us"] > 0
        assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
        factor = bench_comm.bus_factor(r["op"], r["devices"])
        assert r["busbw"] == pytest.approx(r["algbw"] * factor)
    assert result["mesh"]["data"] == 2 and result["mesh"]["tensor"] == 4
    text = bench_comm.format_result(result)
    table_rows = [line for line in text.splitlines() if ROW.match(line)]
    assert len(table_rows) == len(rows) == 2 * 5 * 3
    assert "# all_gather over mesh axis tensor: 4 devices, 2 group(s)" in text
    assert "# wrong elements in all results: 0" in text


@pytest.mark.parametrize("op", bench_comm.OPS)
def test_a_wrong_result_is_counted(op, monkeypatch):
    """The check is real: a collective that returns its input unchanged (a wrong result for
    every op here) shows up in #wrong."""
    wrong = {  # the right shapes, but no data moved between devices
        "all_gather": lambda n: lambda x: jax.numpy.tile(x, n),
        "reduce_scatter": lambda n: lambda x: x[: x.shape[0] // n],
    }
    identity = lambda n: lambda x: x  # noqa: E731
    monkeypatch.setattr(bench_comm, "_collective", lambda o, a, n: wrong.get(o, identity)(n))
    r = bench_comm.time_one(_mesh(tensor=4, data=2), op, "tensor", 16, np.float32, 1, 0)
    assert r["wrong"] > 0


def test_dtypes_and_a_ring_of_three():
    mesh = _mesh(data=-1, tensor=1)  # 8 devices on data; and a ring of 3 below
    devices3 = jax.devices()[:3]
    mesh3 = sharding.make_mesh(config.MeshConfig(data=3), devices3)
    for m in (mesh, mesh3):
        for dtype in ("bfloat16", "int32"):
            result = bench_comm.bench_comm(
                m, ("all_reduce", "all_to_all"), 100, 100, iters=1, warmup=0, dtype=dtype
            )
            for r in result["rows"]:
                n = m.shape["data"]
                assert r["wrong"] == 0 and r["count"] % n == 0 and r["type"] == dtype
    assert mesh.shape["data"] == 8


def test_one_device_is_a_smoke_test():
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    result = bench_comm.bench_comm(mesh, ("all_reduce", "ppermute"), 64, 64, iters=1, warmup=0)
    assert result["smoke_test"] and [r["axis"] for r in result["rows"]] == ["data", "data"]
    assert all(r["wrong"] == 0 and r["devices"] == 1 for r in result["rows"])
    assert result["rows"][0]["busbw"] == 0  # all-reduce over one device crosses no link
    assert "one device: a smoke test" in bench_comm.format_result(result)


def test_cli_in_process_writes_json(tmp_path, capsys):
    out = tmp_path / "comm.json"
    argv = ["bench", "comm", "mesh.tensor=4", "--ops", "all_reduce,ppermute", "mesh.data=2"]
    argv += ["--min-bytes", "1K", "--max-bytes", "2K", "--iters", "2", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["mesh"]["tensor"] == 4 and data["mesh"]["data"] == 2
    assert len(data["rows"]) == 2 * 2 * 2 and all(r["wrong"] == 0 for r in data["rows"])
    assert len([line for line in text.splitlines() if ROW.match(line)]) == 8


def test_cli_in_a_process_of_8_cpu_devices():
    argv = ["bench", "comm", "mesh.data=2", "mesh.tensor=4", "--max-bytes", "2K", "--iters", "2"]
    p = subprocess.run(
        [sys.executable, "-m", "jaxllm", *argv], env=cpu_env(8), capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    rows = [ROW.match(line) for line in p.stdout.splitlines() if ROW.match(line)]
    assert len(rows) == 5 * 2 * 2  # 5 collectives, 2 axes, 1K and 2K
    assert all(m.group(8) == "0" for m in rows)  # #wrong
    assert {m.group(1) for m in rows} == {"1024", "2048"}
    assert "over mesh axis data: 2 devices" in p.stdout
    assert "over mesh axis tensor: 4 devices" in p.stdout


@pytest.mark.parametrize(
    "args, said",
    [
        (["--ops", "all_reduce,broadcast"], "--ops names 'broadcast'"),
        (["--min-bytes", "4K", "--max-bytes", "1K"], "is larger than --max-bytes"),
        (["--max-bytes", "lots"], "--max-bytes 'lots' is not a size"),
        (["mesh.data=16"], "multiply to 16 but there are 8 devices"),
        (["--dtype", "float64"], "--dtype 'float64' is not one of"),
        (["--iters", "0"], "--iters must be >= 1"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(args, said, capsys):
    assert main(["bench", "comm", "mesh.data=-1", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxllm: ") and said in err, err


def test_two_processes_of_4_devices(tmp_path):
    """The README's multi-host use: one command per process, the `data` axis across them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "jaxllm", "bench", "comm", "mesh.data=2", "mesh.tensor=4"]
    argv += ["--ops", "all_reduce,all_gather", "--max-bytes", "1K", "--iters", "2"]
    argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    procs = [
        subprocess.Popen(
            [*argv, "--process-id", str(i), "--json", str(tmp_path / f"{i}.json")],
            env=cpu_env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    data = json.loads((tmp_path / "0.json").read_text())
    assert not (tmp_path / "1.json").exists()  # process 0 reports
    assert data["processes"] == 2 and data["device"] == "8 x cpu"
    assert len(data["rows"]) == 2 * 2 and all(r["wrong"] == 0 for r in data["rows"])
    assert "# wrong elements in all results: 0" in outs[0]
