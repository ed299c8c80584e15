"""What a user watches while a run goes: its speed and memory, and whether evaluation still
improves (`train.early_stopping`, `checkpoint.keep_best`).

`Speed` turns a logging window into `tokens_per_s`, `step_time_s`, `mfu` (where the device's
peak is known: `jaxllm.metrics.peak_flops`, the analytic FLOPs of `flops_per_token`, as
`jaxllm bench` computes them) and `memory_in_use_bytes` / `memory_peak_bytes` (the first
local device's `memory_stats()`, where the backend gives them: the CPU does not, and the keys
are then absent, never zero).

`Best` follows the watched eval metric. Its state (best value, best step, evaluations since
the last improvement) is the JSON item `best` of every checkpoint, so a run resumed after a
crash stops at the step and keeps the best checkpoint the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxllm import checkpoint
from jaxllm.checkpoint.files import BEST_ITEM
from jaxllm.config import ConfigError
from jaxllm.config.train import watched_metric
from jaxllm.metrics import flops_per_token, peak_flops


class Speed:
    """The speed, MFU and memory metrics of a logging window."""

    def __init__(self, cfg, devices=None):
        devices = devices or jax.devices()
        self.tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        peak = peak_flops(devices[0].device_kind)
        self.peak = peak * len(devices) if peak else None
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)["total"]
        self.device = jax.local_devices()[0]

    def metrics(self, elapsed: float, steps: int) -> dict[str, float]:
        elapsed = max(elapsed, 1e-9)
        out = {
            "step_time_s": elapsed / steps,
            "tokens_per_s": self.tokens_per_step * steps / elapsed,
        }
        if self.peak:
            out["mfu"] = out["tokens_per_s"] * self.flops_per_token / self.peak
        stats = self.device.memory_stats() or {}
        for key, name in (
            ("bytes_in_use", "memory_in_use_bytes"),
            ("peak_bytes_in_use", "memory_peak_bytes"),
        ):
            if stats.get(key) is not None:
                out[name] = float(stats[key])
        return out


# How a metric improves when `train.early_stopping.mode` is null: these go up, every other
# metric (`eval_loss` and the objective's other losses) goes down.
HIGHER_IS_BETTER = ("eval_reward", "eval_accuracy", "eval_margin", "eval_chosen_reward")


def direction(metric: str, mode: str | None) -> str:
    return mode or ("max" if metric in HIGHER_IS_BETTER else "min")


@dataclasses.dataclass
class Best:
    """The watched eval metric's best value so far, its step, and the evaluations since."""

    metric: str
    mode: str  # min | max
    min_delta: float = 0.0
    value: float | None = None
    step: int | None = None
    since: int = 0

    @classmethod
    def of(cls, cfg, ckpt_dir, start: int) -> Best | None:
        """The run's watcher when `train.early_stopping` or `checkpoint.keep_best` is on, with
        the state saved in checkpoint `start` (a resume) when it watched the same metric."""
        es = cfg.train.early_stopping
        if not (es.patience or cfg.checkpoint.keep_best):
            return None
        metric = watched_metric(cfg.train)
        best = cls(metric, direction(metric, es.mode), es.min_delta)
        saved = checkpoint.read_json_item(ckpt_dir, start, BEST_ITEM) if start else None
        if saved and saved.get("metric") == best.metric and saved.get("mode") == best.mode:
            best.value, best.step, best.since = saved["value"], saved["step"], saved["since"]
        return best

    def record(self) -> dict:
        return {
            "metric": self.metric,
            "mode": self.mode,
            "value": self.value,
            "step": self.step,
            "since": self.since,
        }

    def update(self, step: int, values: dict) -> bool:
        """Takes evaluation `values` at `step`; True when the metric improved by more than
        `min_delta` (or is the first). ConfigError when the objective does not log it."""
        if self.metric not in values:
            logged = sorted(k for k in values if k.startswith("eval_"))
            raise ConfigError(
                f"train.early_stopping.metric={self.metric} is not a metric this run evaluates "
                f"(it logs {', '.join(logged) or 'no eval metrics'})."
            )
        v = values[self.metric]
        gain = (
            (self.value - v if self.mode == "min" else v - self.value)
            if self.value is not None
            else None
        )
        if math.isfinite(v) and (gain is None or gain > self.min_delta):
            self.value, self.step, self.since = v, step, 0
            return True
        self.since += 1
        return False

    def exhausted(self, patience: int | None) -> bool:
        return bool(patience) and self.since >= patience

    def why(self, patience: int) -> str:
        best = (
            f"the best, {self.value:.4g}, was at step {self.step}"
            if self.value is not None
            else "no evaluation was finite"
        )
        return (
            f"{self.metric} has not improved by more than {self.min_delta:g} for {self.since} "
            f"evaluation(s) (train.early_stopping.patience={patience}); {best}"
        )


def nothing_to_do(cfg, best: Best | None, start: int) -> str | None:
    """Why a resumed run has nothing to train: its steps are done, or it stopped early."""
    if start >= cfg.train.steps:
        return f"the checkpoint is at step {start} and train.steps={cfg.train.steps}"
    patience = cfg.train.early_stopping.patience
    if best is not None and best.exhausted(patience):
        return f"the run stopped early at step {start}: {best.why(patience)}"
    return None
