"""What keeps the suite's long-lived workers alive and its runs finite: the `--dist loadscope`
scheduler (tests/xdist_crash_safe.py) ends a run whose worker crashes, with only the crashed test
failed (pytest-xdist 3.8's own hangs on this layout), and dropping jax's caches gives back the
memory mappings of compiled executables (conftest's `_bounded_executables`)."""

import gc
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from conftest import MAP_LIMIT, memory_maps

QUICK = "def test_1():\n    pass\n\n\ndef test_2():\n    pass\n"
CRASH = "import ctypes\n\n\ndef test_1():\n    ctypes.string_at(0)\n\n\n" + QUICK.replace(
    "test_1", "test_3"
)


def test_a_segfaulting_worker_fails_its_test_and_the_run_still_ends(tmp_path):
    for i in range(12):
        (tmp_path / f"test_m{i:02d}.py").write_text(CRASH if i == 7 else QUICK)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "xdist_crash_safe"]
        + ["-n", "2", "--dist", "loadscope", "-q", str(tmp_path)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(Path(__file__).parent), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    summary = run.stdout.strip().splitlines()[-1]
    assert "1 failed, 24 passed" in summary, run.stdout[-2000:]
    assert "crashed while running 'test_m07.py::test_1'" in run.stdout


def test_dropping_jax_caches_gives_back_the_executables_memory_maps():
    assert MAP_LIMIT > 1000, "vm.max_map_count is unreadable: the suite's workers run unbounded"
    jax.clear_caches()
    gc.collect()
    before = memory_maps()
    kept = [jax.jit(lambda x, i=i: jnp.sin(x) * i + jnp.cos(x @ x.T).sum()) for i in range(100)]
    for i, f in enumerate(kept):  # held, as module-level jitted functions are
        f(jnp.ones((8, 8 + i))).block_until_ready()
    grown = memory_maps()
    assert grown > before + 100 * 4  # several mappings per live executable
    jax.clear_caches()
    gc.collect()
    assert memory_maps() < before + 0.4 * (grown - before)
