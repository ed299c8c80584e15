"""What a training run shows while it runs: log lines, the progress bar, the sample at the end."""

from __future__ import annotations

import dataclasses
import sys

import jax

from jaxllm import config
from jaxllm.data.tokenizer import make_tokenizer
from jaxllm.infer import generate
from jaxllm.model import abstract_model, merge_model


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, file=sys.stderr, flush=True)


def sample(cfg: config.Config, params, frozen=None, model_state=None) -> str:
    """Greedy continuation of `train.sample_prompt` (KV-cached, `generate.*` cache settings),
    printed to stdout."""
    tok = make_tokenizer(cfg.data)
    graphdef, _, _ = abstract_model(cfg.model, cfg.peft)
    model = merge_model(graphdef, *jax.device_get((params, frozen, model_state)))
    bos = [tok.bos_id] if cfg.data.add_bos and tok.bos_id is not None else []
    n = min(cfg.train.sample_tokens, cfg.model.max_seq_len - 1)
    prompt = [*bos, *tok.encode(cfg.train.sample_prompt).tolist()]
    prompt = prompt[-(cfg.model.max_seq_len - n) :]
    gen = dataclasses.replace(cfg.generate, max_new_tokens=n, temperature=0.0)
    new = generate(model, [prompt], gen).tokens[0]
    text = tok.decode(new)
    print(f"--- greedy continuation of {cfg.train.sample_prompt!r} ---")
    print(cfg.train.sample_prompt + text)
    return text


def parameter_line(cfg: config.Config, params) -> str:
    """The start-up line naming the model's size; under `peft` also how much of it trains (the
    adapters: `params` then holds them alone, as PEFT's `print_trainable_parameters` says)."""
    n = sum(x.size for x in jax.tree.leaves(params))
    if cfg.peft.method == "none":
        return f"model: {n:,} parameters"
    base = sum(x.size for x in jax.tree.leaves(abstract_model(cfg.model)[1]))
    return f"model: {base:,} parameters; {n:,} trained ({100 * n / base:.2f}%, {cfg.peft.method})"


class _Plain:
    """Stand-in for tqdm when stderr is not a terminal: log lines only, each with the time
    left to step `total` at the line's speed (evaluation not counted)."""

    def __init__(self, total: int | None = None):
        self.total = total

    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, start: int = 0):
    if not sys.stderr.isatty():
        return _Plain(total)
    from tqdm import tqdm

    return tqdm(total=total, initial=start, unit="step", file=sys.stderr)


def _show(bar, step: int, v: dict) -> None:
    text = f"loss {v['loss']:.3f}  {v['tokens_per_s']:,.0f} tok/s  lr {v['lr']:.2e}"
    if "mfu" in v:  # where the device's peak is known
        text += f"  mfu {100 * v['mfu']:.1f}%"
    if "memory_in_use_bytes" in v:  # where the backend reports it
        text += f"  mem {v['memory_in_use_bytes'] / 2**30:.2f}"
        if "memory_peak_bytes" in v:
            text += f"/{v['memory_peak_bytes'] / 2**30:.2f}"
        text += " GiB"
    if "eval_loss" in v:
        text += f"  eval {v['eval_loss']:.3f}"
    if "eval_accuracy" in v:  # a reward model's held-out pairs ranked right
        text += f"  eval acc {v['eval_accuracy']:.3f}"
    if isinstance(bar, _Plain):
        line = f"step {step}: {text}  {v['step_time_s'] * 1e3:.0f} ms/step"
        if bar.total and step < bar.total:
            minutes, seconds = divmod(round((bar.total - step) * v["step_time_s"]), 60)
            line += f"  eta {minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
        _log(line)
    else:
        bar.set_postfix_str(text)
