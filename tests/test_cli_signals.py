"""SIGTERM in the `jaxllm` program outside `train` and `serve`: like Ctrl-C, it ends the command
with one line (`jaxllm: terminated`, exit 143) and removes the output being written, whose
hidden partial sibling a plain kill would leave behind; the old output stays."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import cpu_env

# A command that writes OUT as every directory writer does (`config.outputs.written`) and
# waits there, run by the program's own entry point.
COMMAND = textwrap.dedent(
    """
    import sys, time, types
    from pathlib import Path
    import jaxllm.cli as cli
    from jaxllm.config.outputs import written

    def write(ns):
        with written(sys.argv[1], flag="OUT", overwrite=True) as tmp:
            (Path(tmp) / "half").write_text("x")
            print("writing", flush=True)
            time.sleep(120)
        return 0

    cli.parse = lambda argv: types.SimpleNamespace(func=write)
    cli.entry()
    """
)


@pytest.mark.parametrize("old", [False, True], ids=["new", "overwrite"])
def test_sigterm_removes_the_output_being_written(tmp_path, old):
    out = tmp_path / "out"
    if old:
        out.mkdir()
        (out / "kept").write_text("old")
    proc = subprocess.Popen(
        [sys.executable, "-c", COMMAND, str(out)],
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "writing"
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name]  # mid-write
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["jaxllm: terminated"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["out"] if old else []), left
    if old:
        assert [p.name for p in out.iterdir()] == ["kept"]
