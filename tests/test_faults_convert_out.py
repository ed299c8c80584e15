"""The output directories of `jaxllm convert import / export`: another model's files, a file in
the way, the run itself, a full disk and an interrupt. Like test_faults.py, each row runs one
command (in-process through `jaxllm.cli.main`, or in a `jaxllm` process under `ulimit -f` for a
full disk) and asserts the exit code, exactly one `jaxllm:` line naming the problem, no
traceback, every input tree and the output directory unchanged, and no hidden partial
directory left beside it. `--overwrite` replaces an old output whole, and an interrupted write
leaves the old one (or none)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import peft
import pytest
import torch
from conftest import cpu_env
from hf_models import REPO, hf_model, run_cli, save_hf
from test_faults import tree_hash

from jaxllm import checkpoint, config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclasses.dataclass(frozen=True)
class Inputs:
    src: Path  # a tiny Llama 2 with a BPE tokenizer.json
    adapter: Path  # a PEFT LoRA of it
    base: Path  # src imported: a full run
    lora: Path  # src + adapter imported: a LoRA run

    def trees(self) -> list[Path]:
        return [self.src, self.adapter, self.base, self.lora]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Inputs:
    from jaxllm.data import train_bpe

    tmp = tmp_path_factory.mktemp("convert_out")
    model = hf_model("llama2")
    src = save_hf(model, tmp / "hf")
    bpe = train_bpe(["def f(x):\n    return x + 1\n"] * 40, 300, tmp / "bpe")
    shutil.copy(bpe, src / "tokenizer.json")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, task_type="CAUSAL_LM")
    peft.get_peft_model(model, lora).save_pretrained(tmp / "adapter")
    assert run_cli("convert", "import", src, tmp / "base", "model.dtype=float32") == 0
    assert run_cli("convert", "import", src, tmp / "lora", "--peft", tmp / "adapter") == 0
    return Inputs(src, tmp / "adapter", tmp / "base", tmp / "lora")


def _state(path: Path) -> str | bytes | None:
    """What is at `path`: nothing, a file's bytes, or a directory's tree hash."""
    if path.is_dir():
        return tree_hash(path)
    return path.read_bytes() if path.exists() else None


@dataclasses.dataclass
class Case:
    id: str
    argv: Callable[[Inputs, Path], list]  # (inputs, OUT) -> command line
    code: int
    says: str  # a fragment of the one message line
    setup: Callable[[Inputs, Path], Inputs | None] | None = None  # fills OUT, breaks a copy
    file_limit_kb: int | None = None  # run as a process under `ulimit -f` (a full disk)


def _another_export(i: Inputs, out: Path) -> None:
    shutil.copytree(i.src, out)  # another model's config.json, safetensors, tokenizer


def _another_adapter(i: Inputs, out: Path) -> None:
    shutil.copytree(i.adapter, out)


def _notes(i: Inputs, out: Path) -> None:
    out.mkdir()
    (out / "notes.txt").write_text("someone else's directory\n")


def _a_file(i: Inputs, out: Path) -> None:
    out.write_text("not a directory\n")


def _damaged_run(i: Inputs, out: Path) -> Inputs:
    """OUT occupied, and a copy of the run whose checkpoint cannot be read: the refusal of
    OUT must come before the (long) restore."""
    _another_export(i, out)
    run = out.parent / "damaged"
    shutil.copytree(i.base, run)
    for f in (run / "checkpoints").rglob("*"):
        if f.is_file() and "params" in f.parts:
            f.unlink()
    return dataclasses.replace(i, base=run)


def _broken_src(i: Inputs, out: Path) -> Inputs:
    """OUT occupied, and a copy of the Hugging Face directory whose config.json is broken."""
    _notes(i, out)
    src = out.parent / "broken"
    shutil.copytree(i.src, src)
    (src / "config.json").write_text('{"model_type": "llama",')
    return dataclasses.replace(i, src=src)


EXPORT, IMPORT = ["convert", "export"], ["convert", "import"]

CASES = [
    # an occupied output is refused, before any loading (exit 2)
    Case(
        "export-over-another-export",
        lambda i, o: [*EXPORT, i.base, o],
        2,
        "already holds",
        _another_export,
    ),
    Case(
        "export-peft-over-another-adapter",
        lambda i, o: [*EXPORT, i.lora, o, "--peft"],
        2,
        "already holds",
        _another_adapter,
    ),
    Case(
        "export-merge-over-another-export",
        lambda i, o: [*EXPORT, i.lora, o, "--merge"],
        2,
        "already holds",
        _another_export,
    ),
    Case(
        "export-occupied-checked-before-restore",
        lambda i, o: [*EXPORT, i.base, o],
        2,
        "already holds",
        _damaged_run,
    ),
    Case("export-out-is-a-file", lambda i, o: [*EXPORT, i.base, o], 2, "is a file", _a_file),
    Case(
        "export-out-under-a-file",
        lambda i, o: [*EXPORT, i.base, o / "sub"],
        2,
        "cannot be made",
        _a_file,
    ),
    Case(
        "export-overwrite-into-its-own-run",
        lambda i, o: [*EXPORT, i.base, i.base, "--overwrite"],
        2,
        "which this command reads",
    ),
    Case("import-into-occupied", lambda i, o: [*IMPORT, i.src, o], 2, "already holds", _notes),
    Case(
        "import-peft-into-occupied",
        lambda i, o: [*IMPORT, i.src, o, "--peft", i.adapter],
        2,
        "already holds",
        _notes,
    ),
    Case(
        "import-occupied-checked-before-reading",
        lambda i, o: [*IMPORT, i.src, o],
        2,
        "already holds",
        _broken_src,
    ),
    Case(
        "import-overwrite-into-its-source",
        lambda i, o: [*IMPORT, i.src, i.src, "--overwrite"],
        2,
        "which this command reads",
    ),
    Case(
        "import-peft-overwrite-into-its-adapter",
        lambda i, o: [*IMPORT, i.src, i.adapter, "--peft", i.adapter, "--overwrite"],
        2,
        "which this command reads",
    ),
    # a full disk: one line, exit 1, nothing left (safetensors and Orbax raise their own errors)
    Case("export-disk-full", lambda i, o: [*EXPORT, i.base, o], 1, "File too large", None, 200),
    Case(
        "export-peft-disk-full",
        lambda i, o: [*EXPORT, i.lora, o, "--peft"],
        1,
        "File too large",
        None,
        24,
    ),
    # (24 KB: Orbax may write the tensors as several data files, each under a larger limit)
    Case("import-disk-full", lambda i, o: [*IMPORT, i.src, o], 1, "File too large", None, 24),
]


def _run(argv: list, limit_kb: int | None, capsys) -> tuple[int, str, str]:
    if limit_kb is None:
        code = run_cli(*argv)
        out, err = capsys.readouterr()
        return code, out, err
    command = [sys.executable, "-m", "jaxllm", *map(str, argv)]
    env = cpu_env()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # its entries would meet the limit too
    p = subprocess.run(
        ["bash", "-c", f'ulimit -f {limit_kb} && exec "$@"', "-", *command],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_convert_output_fault(case: Case, inputs, tmp_path, capsys):
    out = tmp_path / "out"
    used = (case.setup(inputs, out) if case.setup else None) or inputs
    watched = [*used.trees(), out]
    before = [_state(p) for p in watched]
    listing = sorted(os.listdir(tmp_path))
    code, stdout, err = _run(case.argv(used, out), case.file_limit_kb, capsys)
    messages = [ln for ln in err.splitlines() if ln.startswith("jaxllm:")]
    assert code == case.code, err
    assert len(messages) == 1, err
    assert case.says in messages[0], messages[0]
    assert "Traceback" not in stdout + err
    assert [_state(p) for p in watched] == before, "an input or the output changed"
    assert sorted(os.listdir(tmp_path)) == listing, "something was left beside the output"


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("how", [[], ["--peft"], ["--merge"]], ids=["full", "peft", "merge"])
def test_overwrite_replaces_an_old_export_whole(how, inputs, tmp_path):
    run = inputs.lora if how else inputs.base
    assert run_cli(*EXPORT, run, tmp_path / "fresh", *how) == 0
    out = tmp_path / "out"
    _another_export(inputs, out)
    (out / "model-00001-of-00002.safetensors").write_bytes(b"a stale shard")
    assert run_cli(*EXPORT, run, out, *how, "--overwrite") == 0
    assert _files(out) == _files(tmp_path / "fresh")
    assert sorted(os.listdir(tmp_path)) == ["fresh", "out"]


@pytest.mark.parametrize("how", [[], ["--peft"]], ids=["full", "peft"])
def test_exported_weights_are_as_readable_as_the_json_beside_them(how, inputs, tmp_path):
    # safetensors 0.8 writes 0600 files: a server running as another user could not read them
    assert run_cli(*EXPORT, inputs.lora if how else inputs.base, tmp_path / "out", *how) == 0
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "out").iterdir()}
    assert len(set(modes.values())) == 1, modes


def test_overwrite_replaces_an_old_run_whole(inputs, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(inputs.lora, out)
    (out / "checkpoints" / "7").mkdir()
    assert run_cli(*IMPORT, inputs.src, out, "model.dtype=float32", "--overwrite") == 0
    assert config.load(out / "config.yaml").peft.method == "none"
    assert checkpoint.steps(out / "checkpoints") == [0]
    assert sorted(os.listdir(out / "checkpoints")) == ["0"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def _interrupt_before(names: tuple[str, ...], monkeypatch) -> None:
    """Ctrl-C as the command writes the first file named in `names` (after the weights)."""
    write_text = pathlib.Path.write_text

    def interrupted(self, *args, **kwargs):
        if self.name in names:
            raise KeyboardInterrupt
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", interrupted)


@pytest.mark.parametrize("occupied", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("how", [[], ["--peft"], ["--merge"]], ids=["full", "peft", "merge"])
def test_an_interrupted_export_leaves_the_old_output(how, occupied, inputs, tmp_path, monkeypatch):
    out = tmp_path / "out"
    if occupied:
        _another_export(inputs, out)
    before = _state(out)
    _interrupt_before(("config.json", "adapter_config.json"), monkeypatch)
    run = inputs.lora if how else inputs.base
    assert run_cli(*EXPORT, run, out, *how, *(["--overwrite"] if occupied else [])) == 130
    assert _state(out) == before
    assert sorted(os.listdir(tmp_path)) == (["out"] if occupied else [])


@pytest.mark.parametrize("how", [[], ["--peft"]], ids=["full", "peft"])
def test_an_interrupted_import_leaves_nothing(how, inputs, tmp_path, monkeypatch):
    save_params = checkpoint.save_params

    def interrupted(*args, **kwargs):  # the checkpoint complete, the rest not yet
        save_params(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_params", interrupted)
    peft_args = ["--peft", inputs.adapter] if how else []
    assert run_cli(*IMPORT, inputs.src, tmp_path / "out", *peft_args) == 130
    assert os.listdir(tmp_path) == []


@pytest.fixture(autouse=True)
def _quiet_torch():
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
