"""A new run written inside a run it is made from (`jaxllm prune SRC SRC/x`, `jaxllm merge
RUN/x RUN ...`) is refused in one line before anything is read or written, as `jaxllm quantize`
refuses it (tests/test_faults_quantize.py)."""

from __future__ import annotations

import pytest

from jaxllm.cli import main


@pytest.fixture
def run(tmp_path):
    """A directory that looks like a run to the commands' first checks."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {}\n")
    return run


@pytest.mark.parametrize(
    "argv",
    [
        lambda r, o: [
            "prune",
            str(r),
            str(r / "pruned"),
            "--method",
            "magnitude",
            "--sparsity",
            "0.5",
        ],
        lambda r, o: [
            "prune",
            str(r),
            str(r / "checkpoints" / "p"),
            "--method",
            "magnitude",
            "--sparsity",
            "0.5",
        ],
        lambda r, o: ["merge", str(r / "merged"), str(r), str(o), "--method", "linear"],
        lambda r, o: ["merge", str(o / "m"), str(r), str(o), "--method", "linear"],
    ],
    ids=["prune", "prune-checkpoints", "merge-first", "merge-second"],
)
def test_a_new_run_inside_its_source_is_refused(argv, run, tmp_path, capsys):
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "config.yaml").write_text("run: {}\n")
    before = sorted(p.name for p in run.rglob("*")), sorted(p.name for p in other.rglob("*"))
    assert main(argv(run, other)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxllm:") and "lies inside" in err[0], err
    assert (
        sorted(p.name for p in run.rglob("*")),
        sorted(p.name for p in other.rglob("*")),
    ) == before
