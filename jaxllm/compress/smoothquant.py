"""SmoothQuant (Xiao et al. 2022, arXiv:2211.10438): W8A8 int8 with the activations' outlier
channels migrated into the weights.

For each norm and the weights reading its output (a block's q/k/v projections, its MLP's gate
and up projections, routed and shared experts included, as llm-compressor's mappings), per
input channel j, from the calibration rows' max |x_j| and the weights' max |w_j| over their
outputs:

    s_j = max|x_j|^alpha / max|w_j|^(1 - alpha)   (both floored at 1e-5, alpha 0.5)

and X W = (X / s)(diag(s) W): the weights' rows are multiplied by s and the norm's scale (and
LayerNorm bias) divided by it, as AWQ folds (`jaxllm.compress.awq`: the MoE router's rows
compensated). Then every chosen weight is int8 per output channel, run as W8A8: activations
quantized per token at run time, an int8 x int8 dot in int32 (`jaxllm.model.coded`). The other
projections (o, down) are W8A8 without smoothing, as in the paper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.compress import awq
from jaxllm.compress.weights import encoder
from jaxllm.config import Config


def scales(act_absmax, weights, alpha: float):
    """s [K] from the activations' max |x| [K] and the readers' weights [*lead, K, N]."""
    a = jnp.maximum(act_absmax.astype(jnp.float32), 1e-5)
    w_max = jnp.max(
        jnp.stack(
            [jnp.abs(w.astype(jnp.float32)).reshape(-1, *w.shape[-2:]).max((0, 2)) for w in weights]
        ),
        0,
    )
    return a**alpha / jnp.maximum(w_max, 1e-5) ** (1 - alpha)


def smoothquant_unit(params: dict, chosen: dict, stats: dict, cfg: Config, prefix: str, ctx=None):
    """A block's (or the model's head's) parameters smoothed and W8A8-coded (module
    docstring)."""
    q = cfg.quantize
    # one program per unit: on a mesh, eager ops would each run the partitioned reshapes'
    # collectives on their own (and the CPU runtime can deadlock on many of them in flight)
    out = _smoothing(tuple(sorted(chosen.items())), cfg)(params, stats)
    fn = jax.jit(encoder(q), static_argnames=("cfg", "n_in", "n_out"))
    for path, (n_in, n_out) in chosen.items():
        awq._set(out, path, fn(awq._get(out, path), q, n_in=n_in, n_out=n_out))
    return out


@functools.lru_cache(maxsize=8)
def _smoothing(chosen: tuple, cfg: Config):
    """The jitted smoothing of a unit's parameters given its calibration statistics: each norm's
    readers scaled by s and the norm divided by it (the units of a model share one program)."""
    chosen = dict(chosen)

    def smooth(params: dict, stats: dict) -> dict:
        out = jax.tree.map(lambda x: x, params)
        for producer, readers, kind in awq.sets(params, cfg):
            measured = [r for r in readers if r in chosen]
            if kind != "norm" or not measured:
                continue
            act = jnp.max(
                jnp.stack(
                    [
                        stats[r]["abs_max"].reshape(-1, stats[r]["abs_max"].shape[-1]).max(0)
                        for r in measured
                    ]
                ),
                0,
            )
            weights = [awq._flat(awq._get(out, r), *chosen[r]) for r in measured]
            s = scales(act, weights, cfg.quantize.smoothquant.alpha)
            for r in readers:
                awq._set(out, r, awq._scale_rows(awq._get(out, r), s, *awq._in_dims(params, r)))
            awq._fold(out, producer, kind, s, cfg)
        return out

    return jax.jit(smooth)
