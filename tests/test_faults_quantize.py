"""Bad input of `jaxllm quantize`: an unknown method, bits or a group size the method does not
take, a group size that does not divide a weight's input channels, calibration options for a
method without calibration, too few calibration tokens, GPTQ's act order with dynamic groups,
a group size for a fixed-grid kind, exporting a kind the compressed-tensors export does not
write, a source that is already quantized, does not exist or is not a run, an existing OUT, an
OUT that is, holds or lies inside the source run (or a checkpoint.dir inside it), run.dir or
model shapes set as keys, --overwrite onto a directory that is not a run, training a
quantized run, and `quantize.*` keys on a training run, where they would do nothing.

Like test_faults.py, every row runs one command on a copy of the shared small run and asserts
the exit code, exactly one `jaxllm:` line naming the problem, no traceback, an unchanged run
directory, and a scratch directory (where OUT would go) that is unchanged too: nothing written.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from conftest import SMALL_RUN
from test_faults import Case, assert_one_line, fault_output, tree_hash

from jaxllm.cli import main


def _quantize(*options, out="out"):
    return lambda r, t: ["quantize", str(r), str(t / out), *options]


def _existing_out(run, tmp) -> None:
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine\n")


def _quantized(run, tmp) -> None:
    assert main(["quantize", str(run), str(tmp / "q"), "--method", "rtn"]) == 0


CASES = [
    Case(
        "unknown-method",
        _quantize("--method", "gptq9"),
        2,
        "method (--method) gptq9 is not a quantization method jaxllm has; it has rtn",
    ),
    Case(
        "bits-the-method-does-not-take",
        _quantize("--method", "rtn", "--bits", "5"),
        2,
        "quantize.bits=5: method rtn takes 8, 4, 3, 2 bits",
    ),
    Case(
        "negative-group-size",
        _quantize("--method", "rtn", "--group-size", "-1"),
        2,
        "quantize.group_size must be >= 0",
    ),
    Case(
        "group-size-does-not-divide",
        _quantize("--method", "rtn", "--bits", "4", "--group-size", "48"),
        2,
        "--group-size 48 does not divide the 64 input channels of layers/attn/k_proj",
    ),
    Case(
        "calibration-for-rtn",
        _quantize("--method", "rtn", "--calibration", "calib.txt"),
        2,
        "method (--method) rtn reads no calibration data (calibration, samples: --calibration",
    ),
    Case(
        "calibration-that-is-broken-yaml",
        _quantize("--method", "gptq", "--calibration", "{path: calib.txt"),
        2,
        "--calibration {path: calib.txt: not a path or a YAML mapping (while parsing a flow",
    ),
    Case(
        "too-few-calibration-tokens",
        _quantize("--method", "gptq", "--samples", "100000"),
        2,
        "--samples 100000 needs 6400000: pass more data or fewer --samples",
    ),
    Case(
        "act-order-with-groups-not-static",
        _quantize("--method", "gptq", "--group-size", "32", "quantize.gptq.act_order=true"),
        2,
        "quantize.gptq.act_order with --group-size needs quantize.gptq.static_groups=true",
    ),
    Case(
        "another-method's-settings",
        _quantize("--method", "rtn", "quantize.gptq.block_size=64"),
        2,
        "quantize.gptq.* are method gptq's settings; method rtn does not read them",
    ),
    Case(
        "samples-for-rtn-as-a-key",
        _quantize("--method", "rtn", "quantize.samples=64"),
        2,
        "quantize.samples: method rtn reads no calibration data",
    ),
    Case(
        "a-key-and-its-option",
        _quantize("--method", "rtn", "quantize.method=gptq"),
        2,
        "quantize.method= and --method both set quantize.method; pass one of them",
    ),
    Case(
        "bits-as-a-key-and-an-option",
        _quantize("--method", "rtn", "--bits", "8", "quantize.bits=4"),
        2,
        "quantize.bits= and --bits both set quantize.bits; pass one of them",
    ),
    Case(
        "static-groups-per-channel",
        _quantize("--method", "gptq", "quantize.gptq.static_groups=true"),
        2,
        "quantize.gptq.static_groups needs --group-size: per channel has no groups",
    ),
    Case(
        "skip-matching-no-weight",
        _quantize("--method", "rtn", "quantize.skip=[layers/mlp/down]"),
        2,
        "quantize.skip: 'layers/mlp/down' matches none of the weights --method rtn takes",
    ),
    Case(
        "group-size-with-a-fixed-grid",
        _quantize("--method", "fp8", "--group-size", "32"),
        2,
        "method fp8 has a fixed grid (per output channel, symmetric): it takes no --group-size",
    ),
    Case(
        "export-a-kind-compressed-tensors-cannot-express",
        lambda r, t: ["convert", "export", str(t / "q8"), str(t / "out")],
        2,
        "this run's weights are quantize.method=llm_int8 codes, whose 16-bit outlier features "
        "compressed-tensors cannot express",
        setup=lambda r, t: main(["quantize", str(r), str(t / "q8"), "--method", "llm_int8"]),
    ),
    Case(
        "already-quantized",
        lambda r, t: ["quantize", str(t / "q"), str(t / "out"), "--method", "rtn"],
        2,
        "is already quantized (quantize.method=rtn, 8 bits); quantize the run it was made from",
        setup=_quantized,
    ),
    Case(
        "already-quantized-hugging-face-directory",
        lambda r, t: ["quantize", str(t / "q-hf"), str(t / "out"), "--method", "rtn"],
        2,
        "q-hf is already quantized (its config.json's quantization_config, quant_method "
        "compressed-tensors); quantize the float model it was made from",
        setup=lambda r, t: (
            _quantized(r, t) or main(["convert", "export", str(t / "q"), str(t / "q-hf")])
        ),
    ),
    Case(
        "existing-out-of-a-hugging-face-source",
        lambda r, t: ["quantize", str(t / "hf"), str(t / "out"), "--method", "rtn"],
        2,
        "jaxllm: config error: OUT ",
        setup=lambda r, t: (
            _existing_out(r, t) or main(["convert", "export", str(r), str(t / "hf")])
        ),
    ),
    Case(
        "checkpoint-dir-inside-a-hugging-face-source",
        lambda r, t: [
            "quantize",
            str(t / "hf"),
            str(t / "out"),
            "--method",
            "rtn",
            f"checkpoint.dir={t / 'hf' / 'ck'}",
        ],
        2,
        "ck lies inside ",
        setup=lambda r, t: main(["convert", "export", str(r), str(t / "hf")]),
    ),
    Case(
        "out-in-a-bucket",
        lambda r, t: ["quantize", str(r), "s3://bucket/q", "--method", "rtn"],
        2,
        "OUT s3://bucket/q: jaxllm quantize writes a local directory",
    ),
    Case(
        "existing-out",
        _quantize("--method", "rtn"),
        2,
        "OUT",
        setup=_existing_out,
    ),
    Case(
        "out-inside-the-source-run",
        lambda r, t: ["quantize", str(r), str(r / "q4"), "--method", "rtn"],
        2,
        "q4 lies inside ",
    ),
    Case(
        "out-inside-the-run-of-a-source-step",
        lambda r, t: ["quantize", str(r / "checkpoints" / "4"), str(r / "q"), "--method", "rtn"],
        2,
        "which this command reads; write the quantized run outside it",
    ),
    Case(
        "out-is-the-source",
        lambda r, t: ["quantize", str(r), str(r), "--method", "rtn", "--overwrite"],
        2,
        "which this command reads; choose another directory to write into",
    ),
    Case(
        "source-inside-out",
        lambda r, t: ["quantize", str(r / "checkpoints"), str(r), "--method", "rtn", "--overwrite"],
        2,
        "which this command reads; choose another directory to write into",
    ),
    Case(
        "overwrite-a-directory-that-is-not-a-run",
        _quantize("--method", "rtn", "--overwrite"),
        2,
        "holds files but is not a run (no config.yaml); --overwrite replaces only a run",
        setup=_existing_out,
    ),
    Case(
        "source-that-does-not-exist",
        lambda r, t: ["quantize", str(t / "nowhere"), str(t / "out"), "--method", "rtn"],
        2,
        "nowhere does not exist; give a run or a Hugging Face directory",
    ),
    Case(
        "source-that-is-not-a-run",
        lambda r, t: ["quantize", str(r / "checkpoints" / "4"), str(t / "out"), "--method", "rtn"],
        2,
        "is not a run directory, its checkpoints directory, or a checkpoint step in one",
        setup=lambda r, t: (r / "config.yaml").unlink(),
    ),
    Case(
        "zero-samples",
        _quantize("--method", "gptq", "--samples", "0"),
        2,
        "quantize.samples must be at least 1, not 0",
    ),
    Case(
        "zero-bits",
        _quantize("--method", "rtn", "--bits", "0"),
        2,
        "quantize.bits=0: method rtn takes 8, 4, 3, 2 bits",
    ),
    Case(
        "calibration-file-that-does-not-exist",
        _quantize("--method", "gptq", "--calibration", "/nowhere/calib.txt"),
        2,
        "--calibration /nowhere/calib.txt: path: /nowhere/calib.txt does not exist",
    ),
    Case(
        "run-dir-as-a-key",
        _quantize("--method", "rtn", "run.dir=elsewhere"),
        2,
        "run.dir: OUT names the quantized run's directory; leave run.dir unset",
    ),
    Case(
        "a-model-override-that-changes-the-shapes",
        _quantize("--method", "rtn", "model.num_layers=3"),
        2,
        "the model.* overrides change the model's parameters (first: layers/attn/k_proj: "
        "(2, 64, 2, 16) in SRC, (3, 64, 2, 16) with them)",
    ),
    Case(
        "checkpoint-dir-inside-the-source-run",
        lambda r, t: [
            "quantize",
            str(r),
            str(t / "out"),
            "--method",
            "rtn",
            f"checkpoint.dir={r / 'q'}",
        ],
        2,
        "checkpoint.dir ",
    ),
    Case(
        "a-quantize-key-on-a-training-run",
        lambda r, t: ["train", *SMALL_RUN, f"run.dir={t / 'fresh'}", "quantize.bits=4"],
        2,
        "quantize.bits=4 does nothing: quantize.method=none, and quantize.* only describes",
    ),
    Case(
        "a-quantize-method-setting-on-a-training-run",
        lambda r, t: ["train", *SMALL_RUN, f"run.dir={t / 'fresh'}", "quantize.gptq.block_size=64"],
        2,
        "quantize.gptq.block_size=64 does nothing: quantize.method=none",
    ),
    Case(
        "a-quantize-method-on-a-new-training-run",
        lambda r, t: ["train", *SMALL_RUN, f"run.dir={t / 'fresh'}", "quantize.method=rtn"],
        2,
        "quantize.method=rtn: a run trains float weights, and quantize.* records what jaxllm "
        "quantize made of them",
    ),
    Case(
        "train-a-quantized-run",
        lambda r, t: ["train", str(t / "q" / "config.yaml"), "train.steps=6"],
        2,
        "holds quantized weights (quantize.method=rtn, jaxllm quantize), which do not train",
        setup=_quantized,
    ),
    Case(
        "init-from-a-quantized-run",
        lambda r, t: [
            "train",
            *SMALL_RUN,
            f"run.dir={t / 'fresh'}",
            f"checkpoint.init_from={t / 'q'}",
            "train.steps=6",
        ],
        2,
        "holds quantized weights (quantize.method=rtn, jaxllm quantize), which do not train",
        setup=_quantized,
    ),
]


def check_fault(case, small_run, tmp_path, capsys) -> None:
    """Runs `case` on a copy of the shared small run (its `setup` first) and asserts the
    contract (`assert_one_line`) and that neither the run nor the scratch directory, where an
    output would go, changed."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    if case.setup:
        case.setup(run, scratch)
        capsys.readouterr()
    before, before_scratch = tree_hash(run), tree_hash(scratch)
    code, out, err = fault_output(case.argv(run, scratch), capsys)
    assert_one_line(case, code, out, err)
    assert tree_hash(run) == before, "the command changed the run directory"
    assert tree_hash(scratch) == before_scratch, "the command wrote or changed OUT"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(case: Case, small_run, tmp_path, capsys):
    check_fault(case, small_run, tmp_path, capsys)


def test_a_quantize_key_the_options_leave_unset_is_kept(small_run, tmp_path):
    """`quantize.bits=4` without --bits is the run's bits, not the method's default 8."""
    from jaxllm import config

    out = tmp_path / "q"
    assert main(["quantize", str(small_run), str(out), "--method", "rtn", "quantize.bits=4"]) == 0
    assert config.load(out / "config.yaml").quantize.bits == 4


def test_quantize_head_of_a_model_without_its_own_head_is_refused():
    """A tied head is the embedding, which stays in its dtype: quantize.head would do nothing."""
    from conftest import SMALL_RUN

    from jaxllm import config
    from jaxllm.config import ConfigError
    from jaxllm.quantize import _check_weights

    over = [*SMALL_RUN, "quantize.method=rtn", "quantize.head=true"]
    _check_weights(config.load(None, over))  # an untied head is taken
    with pytest.raises(ConfigError, match="quantize.head=true: this model has no LM head"):
        _check_weights(config.load(None, [*over, "model.tie_embeddings=true"]))


def test_checkpoint_dir_as_a_key_is_where_the_checkpoint_goes(small_run, tmp_path):
    """`checkpoint.dir=` puts the quantized run's checkpoint there, as its config.yaml says
    (it went to OUT/checkpoints, where nothing reads it)."""
    import jaxllm

    out, ckpts = tmp_path / "q", tmp_path / "ckpts"
    argv = ["quantize", str(small_run), str(out), "--method", "rtn", f"checkpoint.dir={ckpts}"]
    assert main(argv) == 0
    assert (ckpts / "0").is_dir() and not (out / "checkpoints").exists()
    assert jaxllm.load_model(out)(np.zeros((1, 4), np.int32)).logits.shape == (1, 4, 320)


def test_a_quantize_key_on_lora_over_a_quantized_run_is_refused(small_run, tmp_path, capsys):
    """LoRA on a quantized run takes its base's quantize section: `quantize.bits=4` beside it,
    with no method, would be dropped silently."""
    q = tmp_path / "q"
    assert main(["quantize", str(small_run), str(q), "--method", "rtn"]) == 0
    capsys.readouterr()
    argv = ["train", *SMALL_RUN, "peft.method=lora", f"checkpoint.init_from={q}",
            "quantize.bits=4", "train.steps=2", f"run.dir={tmp_path / 'r'}"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quantize.bits=4 does nothing: quantize.method=none" in err[0], err
    assert not (tmp_path / "r").exists()
