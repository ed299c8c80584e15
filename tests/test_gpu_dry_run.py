"""The next GPU run, as `scripts/gpu/run.sh`'s header writes it, checked on the CPU with the
stand-in interpreter `scripts/gpu/dry_python.py`: every step's command line parses (scripts'
flags, the 1B configs and their overrides, the pytest selection), so a GPU's minutes are not spent
on a typo. The stand-in itself fails where the real command would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN_SH = REPO / "scripts" / "gpu" / "run.sh"
DRY = [sys.executable, str(REPO / "scripts" / "gpu" / "dry_python.py")]
PEER = REPO.parent / "shared" / "tools" / "torch_llama_step.py"


def next_run_steps() -> list[str]:
    """The steps of the header's next GPU run, its `scripts/gpu/run.sh setup ...` command (the
    continued lines joined)."""
    header = [line.removeprefix("#").strip() for line in RUN_SH.read_text().splitlines()]
    after = next(i for i, line in enumerate(header) if line.startswith("The next GPU run"))
    start = next(i for i in range(after, len(header)) if "scripts/gpu/run.sh setup" in header[i])
    text = ""
    for line in header[start:]:
        text += " " + line.rstrip("\\")
        if not line.endswith("\\"):
            break
    return text.split("scripts/gpu/run.sh", 1)[1].split()


def _dry(tmp_path, steps, **env):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": " ".join(DRY), "TAIL": "3", **env}
    env["RUN_1B"] = str(tmp_path / "random-1b")
    return subprocess.run(["bash", str(RUN_SH), *steps], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=600)  # fmt: skip


def test_the_next_gpu_runs_command_lines_parse(tmp_path):
    steps = [s for s in next_run_steps() if s != "setup"]  # setup installs the checkout
    assert any(s.startswith("train:") for s in steps) and len(steps) >= 8, steps
    env = {"TORCH_PEER": str(PEER)}
    if not PEER.is_file():  # a checkout without the shared tools: the peer's step is left out
        steps = [s for s in steps if not s.startswith("torch_peer")]
    proc = _dry(tmp_path, steps, **env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    ends = re.findall(r"^=== (\S+) rc=(\d+)", proc.stdout, re.M)
    assert len(ends) >= len(steps), proc.stdout
    assert [name for name, rc in ends if rc != "0"] == [], proc.stdout[-4000:]


@pytest.mark.parametrize(
    "argv,code",
    [
        (["scripts/bench_fp8.py", "--shapez", "1"], 2),  # argparse's refusal
        (["-m", "jaxllm", "bench", "train", "configs/models/llama3_2_1b.yaml", "model.remat=x"], 2),
        (["-m", "pytest", "-q", "-o", "addopts=", "tests/test_gpu.py", "-k", "no-such-case"], 5),
        (["scripts/no_such_script.py"], 1),
        (["scripts/gpu/remat_attention_count.py"], 1),  # no argparse: it would run for real
    ],
    ids=["flag", "override", "selection", "missing", "no-dry-form"],
)
def test_the_stand_in_fails_where_the_command_would(argv, code):
    proc = subprocess.run([*DRY, *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-2000:]
