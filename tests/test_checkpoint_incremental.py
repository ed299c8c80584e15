"""`checkpoint.incremental=true`: a save writes only the items that changed since the last one
and hard-links the rest; a LoRA run writes its base record and config once; retention never
breaks a later step; a run killed mid-way resumes bit-identically."""

import json
import os
import signal
import subprocess
import sys

import pytest
from test_checkpoint import REPO, TINY, _run, _start, _wait_for
from test_checkpoint_tiers import _same_run

from jaxllm import config
from jaxllm.checkpoint import increments, read_json_item, steps
from jaxllm.checkpoint.increments import link
from jaxllm.config import ConfigError
from jaxllm.train.loop import train

LORA = [*TINY, "peft.method=lora", "peft.rank=4", "checkpoint.every=2"]


def test_a_lora_run_writes_its_base_record_and_config_once(tmp_path, capsys):
    cfg = config.load(
        None, [*LORA, "train.steps=6", "checkpoint.incremental=true", f"run.dir={tmp_path}"]
    )
    train(cfg)
    out = capsys.readouterr().err
    ckpt = tmp_path / "checkpoints"
    assert steps(ckpt) == [2, 4, 6]
    assert read_json_item(ckpt, 2, increments.ITEM) is None  # the first save writes everything
    for s in (4, 6):
        refs = read_json_item(ckpt, s, increments.ITEM)
        assert {"config", "tokenizer", "base"} <= set(refs), refs
        assert "params" not in refs and "train" not in refs and "data" not in refs
        for item in ("config", "tokenizer", "base"):  # the same bytes on disk, not a copy
            ours, first = ckpt / str(s) / item / "metadata", ckpt / "2" / item / "metadata"
            assert ours.stat().st_ino == first.stat().st_ino
    assert read_json_item(ckpt, 6, "base") == read_json_item(ckpt, 2, "base")
    line = next(x for x in out.splitlines() if "checkpoint 4:" in x)
    assert "bytes written" in line and "base (as at step 2)" in line, line
    written = int(line.split("checkpoint 4: ")[1].split(" bytes")[0].replace(",", ""))
    full = sum(p.stat().st_size for p in (ckpt / "4").rglob("*") if p.is_file())
    assert 0 < written < full


def test_retention_deletes_the_first_copy_and_later_steps_still_read(tmp_path):
    cfg = config.load(
        None,
        [*LORA, "train.steps=6", "checkpoint.keep=1", "checkpoint.incremental=true"]
        + [f"run.dir={tmp_path}"],
    )
    train(cfg)
    ckpt = tmp_path / "checkpoints"
    assert steps(ckpt) == [6]
    assert set(read_json_item(ckpt, 6, increments.ITEM)) >= {"config", "base"}
    assert read_json_item(ckpt, 6, "config")["train"]["steps"] == 6
    proc = subprocess.run(  # a reader of the run sees a whole checkpoint
        [sys.executable, "-m", "jaxllm", "eval", str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path):
    args = [*LORA, "train.steps=8"]
    rc, out = _run([*args, f"run.dir={tmp_path / 'straight'}"])
    assert rc == 0, out
    victim = _start([*args, "checkpoint.incremental=true", f"run.dir={tmp_path / 'killed'}"])
    _wait_for(tmp_path / "killed/checkpoints/6/commit_success.txt", victim)
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    rc, out = _run([str(tmp_path / "killed")])
    assert rc == 0, out
    assert "resumed from step" in out
    _same_run(tmp_path / "straight", tmp_path / "killed")


def test_a_link_a_killed_run_still_owed_is_made_at_the_next_start(tmp_path):
    (tmp_path / "2" / "config").mkdir(parents=True)
    (tmp_path / "2" / "config" / "metadata").write_text(json.dumps({"a": 1}))
    (tmp_path / "4" / increments.ITEM).mkdir(parents=True)
    (tmp_path / "4" / increments.ITEM / "metadata").write_text(json.dumps({"config": 2}))
    for s in (2, 4):
        (tmp_path / str(s) / "_CHECKPOINT_METADATA").write_text("{}")
    increments.repair(tmp_path)
    assert read_json_item(tmp_path, 4, "config") == {"a": 1}
    link(tmp_path, 4, {"config": 2})  # linking again changes nothing
    assert not list((tmp_path / "4").glob(".*"))


def test_incremental_refused_on_object_storage():
    with pytest.raises(ConfigError, match="checkpoint.incremental"):
        config.load(None, ["run.dir=s3://bucket/run", "checkpoint.incremental=true"])


def test_incremental_local_steps_are_promoted_whole(tmp_path, capsys):
    local = tmp_path / "fast"
    keys = [*LORA, "checkpoint.every=4", "checkpoint.local_every=1", f"run.dir={tmp_path / 'r'}"]
    keys += [f"checkpoint.local_dir={local}", "checkpoint.incremental=true"]
    train(config.load(None, [*keys, "train.steps=7", "checkpoint.save_final=false"]))
    assert steps(local) == [5, 6]
    assert "config" in read_json_item(local, 6, increments.ITEM)  # linked from step 5
    train(config.load(None, [*keys, "train.steps=8"]))
    assert "resumed from step 6" in capsys.readouterr().err
    ckpt = tmp_path / "r" / "checkpoints"
    assert read_json_item(ckpt, 6, "config")["checkpoint"]["incremental"] is True
