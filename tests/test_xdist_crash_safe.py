"""The suite's `--dist loadscope` scheduler (tests/xdist_crash_safe.py) ends a run whose worker
crashes, with only the crashed test failed; pytest-xdist 3.8's own hangs on this layout."""

import subprocess
import sys
from pathlib import Path

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
