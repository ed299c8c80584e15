"""`jaxllm eval`: restore only the weights of a run and report loss and perplexity on a dataset.

The dataset is the run's own held-out split unless overrides name another one, e.g.
`data.eval_sources=[{path: valid.jsonl}]`. The held-out split follows training's rules
(`jaxllm.data.pipeline`): one smaller than a batch is one padded batch; with none at all
(`data.eval_fraction=0` and no `data.eval_sources`) there is nothing to evaluate.
"""

from __future__ import annotations

import functools
import math

import jax

from jaxllm import objectives, sharding
from jaxllm.compress import qat
from jaxllm.config import ConfigError
from jaxllm.config.urls import check_url
from jaxllm.data.objective_rows import row_transform
from jaxllm.data.pipeline import eval_batches, load_splits
from jaxllm.data.span_corruption import corrupted_splits
from jaxllm.data.tokenizer import make_tokenizer
from jaxllm.load import fetched, restore
from jaxllm.model import abstract_model
from jaxllm.sharding import process_rows
from jaxllm.train import companions
from jaxllm.train.compiled import evaluate
from jaxllm.train.step import BATCH_AXES, eval_step

__all__ = ["evaluate_checkpoint", "summary"]


def _shardings(tree):
    return jax.tree.map(lambda p: p.sharding, tree)


def evaluate_checkpoint(
    path, overrides=(), num_batches: int | None = None, which: str = "last"
) -> dict:
    """`which`: `--checkpoint best|last|STEP` (`jaxllm.load.pick_step`)."""
    path = fetched(check_url(path, "RUN_DIR"), "RUN_DIR")  # a bucket's run: its local copy
    cfg, mesh, graphdef, params, model_state, step, frozen = restore(path, overrides, which=which)
    batch_sh = sharding.named(mesh, BATCH_AXES)
    objective = objectives.from_config(cfg)
    held = companions.resolve_others(cfg, objective)  # a DPO reference, a teacher
    others = companions.load(held, mesh)
    _, abstract, axes = abstract_model(cfg.model, cfg.peft)
    weights = qat.transform(abstract, axes, cfg.train.qat)  # a QAT run: as it trained
    jit_eval = jax.jit(
        functools.partial(
            eval_step,
            graphdef=graphdef,
            objective=objective,
            parallel_settings=sharding.Parallel.of(mesh, cfg.mesh),
            other_graphdefs=companions.graphdefs(held),
            weights=weights,
        ),
        in_shardings=(
            _shardings(params),
            batch_sh,
            _shardings(model_state),
            _shardings(frozen),
            _shardings(others),
        ),
    )
    gbs = cfg.train.global_batch_size
    whole_inputs = cfg.train.objective == "reward"  # as training packed it (`train.loop`)
    if cfg.train.objective == "span_corruption":  # encoder inputs, decoder targets
        _, eval_rows = corrupted_splits(cfg.data, cfg.model.vocab_size)
    else:
        _, eval_rows = load_splits(cfg.data, cfg.peft.virtual_tokens, whole_inputs)
    if eval_rows is None:
        raise ConfigError(
            "data.eval_fraction=0 holds nothing out and data.eval_sources is empty: there is no "
            "held-out split to evaluate; name one, e.g. data.eval_sources=[{path: valid.jsonl}]."
        )
    batches = eval_batches(
        eval_rows,
        gbs,
        num_batches or cfg.train.eval_batches,
        process_rows(batch_sh, gbs),
        row_transform(cfg, make_tokenizer(cfg.data)),
    )
    results = evaluate(jit_eval, params, batches, batch_sh, model_state, frozen, others)
    read = min(len(batches) * gbs, len(eval_rows))  # the padding rows are not counted
    return {
        "step": step,
        **results,
        "perplexity": math.exp(results["eval_loss"]),
        "tokens": read * cfg.data.seq_len,
        "rows_read": read,
        "rows": len(eval_rows),  # of the held-out split
    }


def summary(r: dict) -> str:
    """The line `jaxllm eval` prints: loss, perplexity, and how much of the split it read."""
    part = f" of {r['rows']:,}; --batches N reads more" if r["rows_read"] < r["rows"] else ""
    return (
        f"step {r['step']}: eval loss {r['eval_loss']:.4f} nats/token, perplexity "
        f"{r['perplexity']:.3f} ({r['tokens']:,} tokens, {r['rows_read']:,} rows{part})"
    )
