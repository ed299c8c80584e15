"""The session's shared runs (trained_runs.py): made once across processes, one recipe a name,
and a changed one is noticed; a module's runs made on first use."""

import subprocess
import sys
from pathlib import Path

import pytest
import trained_runs
from trained_runs import SHARED_RUNS, OnFirstUse, changed, shared

# A process that asks for the shared directory `once` whose making takes a while and counts
# itself in made.txt: both processes start before either has made it.
MAKER = """
import sys, time
sys.path.insert(0, {tests!r})
from trained_runs import shared

def make(out):
    with open(out.parent / "made.txt", "a") as f:
        f.write("made\\n")
    time.sleep(1.0)
    out.mkdir()
    (out / "weights").write_text("w")

print(shared("once", ["recipe"], make))
"""


@pytest.fixture
def base(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(SHARED_RUNS, str(tmp_path))
    return tmp_path


def test_two_processes_make_a_shared_run_once(base):
    code = MAKER.format(tests=str(Path(trained_runs.__file__).parent))
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [str(base / "once")] * 2
    assert (base / "made.txt").read_text() == "made\n"
    assert (base / "once" / "weights").read_text() == "w"


def test_one_name_is_one_recipe_and_a_failed_make_is_made_again(base):
    def fail(out):
        out.mkdir()
        raise RuntimeError("half way")

    with pytest.raises(RuntimeError):
        shared("run", ["a"], fail)
    made = shared("run", ["a"], lambda out: out.mkdir())
    assert made == base / "run" and list(made.iterdir()) == []
    assert shared("run", ["a"], fail) == made  # made already: not made again
    with pytest.raises(AssertionError, match="is \\['a'\\], not \\['b'\\]"):
        shared("run", ["b"], lambda out: out.mkdir())


def test_a_changed_shared_run_is_named(base):
    def make(out):
        (out / "ckpt").mkdir(parents=True)
        (out / "ckpt" / "w").write_text("1")

    run = shared("run", ["a"], make)
    shared("other", ["b"], make)
    assert changed() == []
    (run / "ckpt" / "w").write_text("22")
    assert changed() == ["run"]
    (run / "ckpt" / "w").write_text("1")
    (run / "new").write_text("")
    assert changed() == ["run"]


def test_on_first_use_makes_a_value_once_and_only_when_asked():
    made = []

    def make(name):
        made.append(name)
        return name.upper()

    runs = OnFirstUse(make, given="kept")
    assert made == [] and runs["given"] == "kept"
    assert [runs["b"], runs["b"], runs["a"]] == ["B", "B", "A"]
    assert made == ["b", "a"]
    with pytest.raises(KeyError):
        OnFirstUse({}.__getitem__)["nothing"]
