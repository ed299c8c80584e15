"""What a user watches while a run goes: the speed, MFU and memory metrics, early stopping,
the best checkpoint kept beside the newest ones, and `--checkpoint best|last|STEP`.

One run (`watched`) trains with `train.early_stopping` and `checkpoint.keep_best`; a min_delta
no evaluation can beat makes its course certain: the first evaluation (step 1) is the best,
the next three do not improve, and the run stops at step 4 of 8."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import warnings
from types import SimpleNamespace

import jax
import pytest
from conftest import SMALL_RUN, cpu_env

from jaxllm import checkpoint, config
from jaxllm.cli import main
from jaxllm.metrics import flops_per_token, read_jsonl
from jaxllm.train import watch

WATCHED = [
    *SMALL_RUN,
    "train.steps=8",
    "train.eval_every=1",
    "train.early_stopping.patience=3",
    "train.early_stopping.min_delta=10",
    "checkpoint.keep_best=true",
]


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """The run directory of WATCHED with checkpoint.keep=1: every checkpoint but the best and
    the newest is pruned."""
    run = tmp_path_factory.mktemp("watched") / "run"
    assert main(["train", *WATCHED, "checkpoint.keep=1", f"run.dir={run}"]) == 0
    return run


def test_early_stopping_stops_writes_a_checkpoint_and_says_so(watched, capsys):
    rows = read_jsonl(watched / "metrics.jsonl")
    assert rows[-1]["step"] == 4  # 3 evaluations after the best (step 1) without improvement
    assert checkpoint.steps(watched / "checkpoints") == [1, 4]  # the best, kept; the last
    saved = checkpoint.read_json_item(watched / "checkpoints", 4, checkpoint.BEST_ITEM)
    assert saved == {"metric": "eval_loss", "mode": "min", "value": rows[0]["eval_loss"],
                     "step": 1, "since": 3}  # fmt: skip
    assert checkpoint.best_step(watched / "checkpoints") == 1
    # Run again: it stopped early, so there is nothing to do (and nothing is written).
    before = sorted(p.name for p in (watched / "checkpoints").iterdir())
    assert main(["train", str(watched)]) == 0
    assert "nothing to do: the run stopped early at step 4" in capsys.readouterr().err
    assert sorted(p.name for p in (watched / "checkpoints").iterdir()) == before


def test_the_closing_line_says_it_stopped_early(tmp_path, capsys):
    run = tmp_path / "run"
    argv = [*WATCHED, "train.steps=4", "train.early_stopping.patience=1", "checkpoint.keep=9"]
    assert main(["train", *argv, f"run.dir={run}"]) == 0
    err = capsys.readouterr().err
    assert "stopping at step 2: eval_loss has not improved by more than 10" in err
    assert err.strip().splitlines()[-1].startswith("stopped early: step 2, train loss")
    # keep_best saves at every evaluation (steps 1, 2), the stop writes step 2 once
    assert checkpoint.steps(run / "checkpoints") == [1, 2]


def test_early_stopping_and_the_best_survive_kill_9(watched, tmp_path, capsys):
    """Killed (SIGKILL) once checkpoint 2 is on disk, the run resumes with that checkpoint's
    saved state (best step 1, one evaluation without improvement), so it stops at 4 with step 1
    the best, as the uninterrupted `watched` did. Without the state, step 3 would be the first
    evaluation and the best, and the run would go on to step 6."""
    run = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "jaxllm",
        "train",
        *WATCHED,
        "checkpoint.keep=9",
        f"run.dir={run}",
    ]
    victim = subprocess.Popen(
        argv, env=cpu_env(8), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    marker = run / "checkpoints" / "2" / checkpoint.FINALIZED
    t0 = time.monotonic()
    while not marker.exists():
        assert victim.poll() is None, victim.communicate()[0]
        assert time.monotonic() - t0 < 300, "checkpoint 2 never appeared"
        time.sleep(0.02)
    victim.kill()
    out = victim.communicate()[0]
    assert victim.returncode == -signal.SIGKILL, out  # killed before it could stop on its own
    assert 2 in checkpoint.steps(run / "checkpoints")
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # printed as a `jaxllm: warning:` line
        assert main(["train", str(run)]) == 0
    assert "which is no longer running; taking the run over" in capsys.readouterr().err
    assert read_jsonl(run / "metrics.jsonl")[-1]["step"] == 4
    assert checkpoint.steps(run / "checkpoints") == [1, 2, 3, 4]
    assert checkpoint.best_step(run / "checkpoints") == 1
    first = read_jsonl(watched / "metrics.jsonl")
    again = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in again] == [r["step"] for r in first]
    assert [r["eval_loss"] for r in again] == pytest.approx([r["eval_loss"] for r in first])


def test_keep_best_survives_pruning(tmp_path):
    """Retention spares the step the kept checkpoints record as their best."""
    from jaxllm.config import CheckpointConfig

    ckpts = tmp_path / "checkpoints"
    for step, best in ((1, 1), (2, 1), (3, 1)):
        d = ckpts / str(step)
        (d / checkpoint.BEST_ITEM).mkdir(parents=True)
        (d / checkpoint.FINALIZED).write_text("{}")
        (d / checkpoint.BEST_ITEM / "metadata").write_text(f'{{"step": {best}}}')
    ckpt = checkpoint.Checkpointer(ckpts, CheckpointConfig(keep=1, keep_best=True))
    deleted = []
    ckpt._mgr = SimpleNamespace(reload=lambda: None, delete=deleted.append)
    ckpt.prune()
    assert deleted == [2]  # 1 is the best, 3 the newest
    ckpt.cfg = CheckpointConfig(keep=1)
    deleted.clear()
    ckpt.prune()
    assert deleted == [1, 2]


def test_metrics_speed_and_memory_where_known(watched):
    rows = [r for r in read_jsonl(watched / "metrics.jsonl") if "loss" in r]
    cfg = config.load(watched / "config.yaml")
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    for r in rows:
        assert "tokens_per_sec" not in r
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"])
        # the CPU has no known peak and reports no memory: the keys are absent, not zero
        assert not {"mfu", "memory_in_use_bytes", "memory_peak_bytes"} & set(r)


def test_mfu_and_memory_when_the_device_tells_them(monkeypatch):
    cfg = config.load_args([*SMALL_RUN])
    monkeypatch.setattr(watch, "peak_flops", lambda kind: 100e12 if kind == "TPU v9" else None)
    tpu = SimpleNamespace(device_kind="TPU v9")
    speed = watch.Speed(cfg, devices=[tpu, tpu])
    speed.device = SimpleNamespace(
        memory_stats=lambda: {"bytes_in_use": 3 * 2**30, "peak_bytes_in_use": 5 * 2**30}
    )
    m = speed.metrics(elapsed=2.0, steps=4)
    tokens_per_s = 4 * 8 * 64 / 2.0
    assert m["tokens_per_s"] == tokens_per_s and m["step_time_s"] == 0.5
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)["total"]
    assert m["mfu"] == pytest.approx(tokens_per_s * fpt / 200e12)
    assert (m["memory_in_use_bytes"], m["memory_peak_bytes"]) == (3 * 2**30, 5 * 2**30)
    speed.device = SimpleNamespace(memory_stats=lambda: {"bytes_in_use": 7})  # no peak
    assert "memory_peak_bytes" not in speed.metrics(1.0, 1)
    assert "mfu" not in watch.Speed(cfg, devices=[SimpleNamespace(device_kind="cpu")]).metrics(1, 1)


@pytest.mark.parametrize(
    "mode, values, improved",
    [
        ("min", [3.0, 2.95, 2.5, 2.6], [True, False, True, False]),
        ("max", [0.5, 0.52, 0.7, 0.6], [True, False, True, False]),
        ("min", [0.0, -0.2], [True, True]),  # a best of 0 is a value, not "none yet"
        ("min", [float("nan"), 2.0, float("nan")], [False, True, False]),
    ],
)
def test_best_counts_evaluations_without_improvement(mode, values, improved):
    best = watch.Best("eval_x", mode, min_delta=0.1)
    got = [best.update(step, {"eval_x": v}) for step, v in enumerate(values, 1)]
    assert got == improved
    assert best.since == (0 if improved[-1] else 1)
    assert best.exhausted(1) == (not improved[-1]) and not best.exhausted(None)
    assert "train.early_stopping.patience=1" in best.why(1)


def test_direction_from_the_table_or_mode():
    assert watch.direction("eval_loss", None) == "min"
    assert watch.direction("eval_reward", None) == "max"
    assert watch.direction("eval_accuracy", None) == "max"
    assert watch.direction("eval_accuracy", "min") == "min"


def test_rollout_objectives_watch_eval_reward():
    from jaxllm.config import ConfigError
    from jaxllm.config.train import EarlyStoppingConfig, TrainConfig, validate_early_stopping

    grpo = TrainConfig(objective="grpo", early_stopping=EarlyStoppingConfig(patience=2))
    validate_early_stopping(grpo)  # the default metric is the objective's: eval_reward
    es = EarlyStoppingConfig(patience=2, metric="eval_loss")
    with pytest.raises(ConfigError, match="set train.early_stopping.metric=eval_reward"):
        validate_early_stopping(TrainConfig(objective="grpo", early_stopping=es))
    es = EarlyStoppingConfig(patience=2, metric="eval_reward")
    validate_early_stopping(TrainConfig(objective="grpo", early_stopping=es))


def test_a_metric_the_run_does_not_log_is_named(tmp_path, capsys):
    argv = [*WATCHED, "train.steps=2", "train.early_stopping.metric=eval_accuracy"]
    assert main(["train", *argv, f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "train.early_stopping.metric=eval_accuracy is not a metric this run evaluates" in err
    assert "eval_loss" in err and "Traceback" not in err


def test_checkpoint_option_picks_best_last_or_a_step(watched, capsys):
    for which, step in (("best", 1), ("last", 4), ("1", 1), ("4", 4)):
        assert main(["eval", str(watched), "--checkpoint", which, "--batches", "1"]) == 0
        assert capsys.readouterr().out.startswith(f"step {step}: eval loss")
    rows = {r["step"]: r for r in read_jsonl(watched / "metrics.jsonl")}
    assert main(["eval", str(watched), "--checkpoint", "best", "--batches", "1"]) == 0
    out = capsys.readouterr().out
    assert f"eval loss {rows[1]['eval_loss']:.4f}" in out


def test_generate_and_export_read_the_best_checkpoint(watched, tmp_path, capsys):
    argv = ["generate", str(watched), "--prompt", "def", "--max-new-tokens", "2"]
    assert main([*argv, "--checkpoint", "best"]) == 0
    assert "step 1: 1 prompt(s)" in capsys.readouterr().err
    assert (
        main(["convert", "export", str(watched), str(tmp_path / "hf"), "--checkpoint", "best"]) == 0
    )
    assert "exported step 1 to" in capsys.readouterr().err


def test_the_console_line_shows_speed_mfu_and_memory(capsys):
    from jaxllm.train.console import _Plain, _show

    v = {"loss": 2.0, "tokens_per_s": 1234.0, "lr": 1e-3, "step_time_s": 0.25}
    _show(_Plain(), 3, v)
    assert "1,234 tok/s" in capsys.readouterr().err
    _show(_Plain(), 3, {**v, "mfu": 0.4, "memory_in_use_bytes": 2**30, "memory_peak_bytes": 2**31})
    assert "mfu 40.0%  mem 1.00/2.00 GiB" in capsys.readouterr().err


def test_a_log_line_without_a_terminal_says_the_time_left(capsys):
    from jaxllm.train.console import _Plain, _show

    v = {"loss": 2.0, "tokens_per_s": 1234.0, "lr": 1e-3, "step_time_s": 0.25}
    _show(_Plain(total=20_000), 100, v)  # 19,900 steps left at 0.25 s: 1 h 22 min 55 s
    assert capsys.readouterr().err.rstrip().endswith("250 ms/step  eta 1:22:55")
    _show(_Plain(total=20_000), 20_000, v)  # the last step: nothing left
    assert "eta" not in capsys.readouterr().err


def test_a_signal_between_log_steps_logs_the_step_it_saves(tmp_path, capsys):
    """SIGTERM stops a run between two train.log_every steps: the step the checkpoint holds
    gets its metrics row, and the closing line names it, not the last logged step."""
    import os
    import threading

    from jaxllm.train.loop import train
    from jaxllm.train.signals import Signals

    args = [*SMALL_RUN, "train.steps=100000", "train.log_every=100000", f"run.dir={tmp_path}"]
    with Signals() as signals:

        def terminate():  # once steps run, as a scheduler's preemption would
            while signals.starting:
                time.sleep(0.01)
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=terminate, daemon=True).start()
        result = train(config.load_args(args), signals)
    saved = checkpoint.steps(tmp_path / "checkpoints")
    assert result["stopped"] == "signal" and result["step"] == saved[-1] < 100000, result
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == saved


def test_the_model_line_says_how_much_of_a_peft_model_trains():
    import numpy as np

    from jaxllm.model import abstract_model
    from jaxllm.train.console import parameter_line

    full = config.load(None, SMALL_RUN)
    n = sum(x.size for x in jax.tree.leaves(abstract_model(full.model)[1]))
    assert parameter_line(full, abstract_model(full.model)[1]) == f"model: {n:,} parameters"
    lora = config.load(None, [*SMALL_RUN, "peft.method=lora"])  # params: the adapters alone
    said = parameter_line(lora, {"a": np.zeros(100), "b": np.zeros((2, 50))})
    assert said == f"model: {n:,} parameters; 200 trained ({20000 / n:.2f}%, lora)"
