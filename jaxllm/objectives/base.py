"""What every objective shares: the `ObjectiveOutput` of sums it returns, the `Objective`
signature, and the sums the families build on: `token_nll` and `masked_nll_sums` (the float32
pieces of a token-level cross-entropy, optionally in chunks of the sequence), `token_logps` and
`reference_logps` (per-token log-probabilities of the targets, the policy's and a frozen
reference's), `pair_sums` (per-pair sums of the preference layout), and `load_function` for
the `MODULE:NAME` specs of user code (objectives, rewards). The families (`jaxllm.objectives.*`)
build on this module while the registry, `jaxllm.objectives`, imports them.

Preference pairs in packed rows: a preference row (`jaxllm.data.preference`) holds whole
pairs; pair k of the row is two consecutive segments, its chosen sequence segment 2k + 1 and
its rejected sequence segment 2k + 2 (segment id 0 is padding). Every sequence takes at least
one slot, so at most P = L // 2 pairs fit a row of L slots, and the pair axis has that fixed
size whatever the row holds. The losses of the DPO family and of reward models are functions
of per-sequence sums (log-probabilities, token counts, a score at one position), which
`pair_sums` reads off.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ConfigError
from jaxllm.model import moe as moe_lib


class ObjectiveOutput(NamedTuple):
    """What an objective returns for one (micro)batch; all sums over the batch."""

    loss_sum: jax.Array  # float32 scalar the gradient comes from
    tokens: jax.Array  # float32 scalar: what the sums count; the step divides by the total
    metrics: dict[str, jax.Array] = {}  # sums; logged as sum / tokens (`loss` is eval's loss)
    model_stats: Any = {}  # the model's aux sums (MoE), for `Transformer.after_step`


class Objective(Protocol):
    """What a train or eval step minimises: `objective(model, batch, rng)` -> `ObjectiveOutput`
    of sums over the batch (`next_token()`, `from_config`, or your own function; one that names
    frozen models in `objective.others` also gets them as a fourth argument)."""

    def __call__(self, model: nnx.Module, batch: dict, rng: jax.Array | None, /) -> ObjectiveOutput:
        """The sums of one (micro)batch; `rng`: the step's dropout key, or None."""


def output(model, out, loss_sum, count, metrics: dict) -> ObjectiveOutput:
    """The objective's sums with the model's own terms added: an MoE model's balancing losses
    (`out.aux`, weighted by `count`) join the loss and the metrics, and its routing statistics
    become the output's `model_stats`."""
    stats = {}
    if out.aux:
        extra, aux_metrics, stats = moe_lib.objective_terms(model.cfg.moe, out.aux, count)
        loss_sum += extra
        metrics.update(aux_metrics)
    return ObjectiveOutput(loss_sum, count, metrics, stats)


def token_nll(logits_BxLxV: jax.Array, targets_BxL: jax.Array):
    """(-log p(target) [B, L], log Z [B, L]) in float32: the pieces of a token-level loss."""
    logits_BxLxV = logits_BxLxV.astype(jnp.float32)
    logz_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    # a masked sum rather than a gather: exact (zeros added), split over a vocab-sharded axis
    # as partial sums, and partitioned where XLA's gather fails (inside pipeline stages)
    vocab_BxLxV = jax.lax.broadcasted_iota(jnp.int32, logits_BxLxV.shape, 2)
    hit_BxLxV = vocab_BxLxV == targets_BxL[..., None].astype(jnp.int32)
    target_logit_BxL = jnp.sum(jnp.where(hit_BxLxV, logits_BxLxV, 0.0), axis=-1)
    return logz_BxL - target_logit_BxL, logz_BxL


def masked_nll_sums(model, batch: dict, out, chunks: int = 1):
    """(sum of -log p(target), sum of log Z squared) over the tokens whose `loss_mask` is 1.

    chunks = 1: from `out.logits`. chunks > 1: `out` holds the head's input (`hidden_only`) and
    the LM head and cross-entropy run on L / chunks tokens of each row at a time in a scan,
    each chunk rematerialised in the backward, so the [B, L, V] float32 logits and their
    gradient never exist at once (at a 128k vocabulary they are the largest activation).
    """
    mask_BxL = batch["loss_mask"].astype(jnp.float32)
    if chunks == 1:
        nll_BxL, logz_BxL = token_nll(out.logits, batch["targets"])
        return jnp.sum(nll_BxL * mask_BxL), jnp.sum(jnp.square(logz_BxL) * mask_BxL)
    b, l, d = out.hidden.shape
    if l % chunks:
        raise ValueError(f"{chunks} loss chunks do not divide the sequence length {l}")

    def split(x):  # [B, L, ...] -> [chunks, B, L / chunks, ...]
        return jnp.moveaxis(x.reshape(b, chunks, l // chunks, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def chunk(sums, xs):
        h_BxCxD, targets_BxC, mask_BxC = xs
        nll_BxC, logz_BxC = token_nll(model.head_logits(h_BxCxD), targets_BxC)
        return (
            sums[0] + jnp.sum(nll_BxC * mask_BxC),
            sums[1] + jnp.sum(jnp.square(logz_BxC) * mask_BxC),
        ), None

    zero = jnp.zeros((), jnp.float32)
    xs = (split(out.hidden), split(batch["targets"]), split(mask_BxL))
    (nll_sum, z_sum), _ = jax.lax.scan(chunk, (zero, zero), xs)
    return nll_sum, z_sum


def model_inputs(batch: dict) -> dict:
    """The positions a model reads from `batch`, and the images of image rows
    (`jaxllm.data.vision_rows`): M-RoPE ids [3, B, L] and `image_rows` for the VLM."""
    if "pixel_values" not in batch:
        return {"positions_BxL": batch["positions"]}
    image_rows = {
        "pixels_BxNxI": batch["pixel_values"],
        "positions_BxNx2": batch["pixel_positions"],
        "frames_BxN": batch["pixel_frames"],
        "windows_BxN": batch["pixel_windows"],
        "units_BxL": batch["image_units"],
    }
    if "pixel_taps" in batch:  # a learned position table's taps (Qwen3-VL towers)
        image_rows["taps_BxNxT"] = batch["pixel_taps"]
        image_rows["tap_weights_BxNxT"] = batch["pixel_tap_weights"]
    return {
        "positions_BxL": jnp.moveaxis(batch["mrope_positions"], -1, 0),
        "image_rows": image_rows,
    }


def token_logps(model, batch: dict, rng=None):
    """(log p(target) [B, L] float32, 0 where `loss_mask` is 0; the model's output); image rows
    (`model_inputs`) run with their images."""
    out = model(
        batch["inputs"],
        **model_inputs(batch),
        segment_ids_BxL=batch["segment_ids"],
        dropout_key=rng,
    )
    nll_BxL, _ = token_nll(out.logits, batch["targets"])
    return -nll_BxL * batch["loss_mask"].astype(jnp.float32), out


def reference_logps(reference, batch: dict) -> jax.Array:
    """The reference's per-token log-probabilities of a batch's targets [B, L] (0 outside the
    loss mask), without gradient: what `batch["ref_logps"]` holds when precomputed."""
    return jax.lax.stop_gradient(token_logps(reference, batch)[0])


def pair_sums(x_BxL: jax.Array, segment_ids_BxL: jax.Array):
    """(chosen_BxP, rejected_BxP, valid_BxP): the sums of `x` over each pair's chosen segment
    (2k + 1) and rejected segment (2k + 2), and whether both segments are present in the row
    (True where the pair exists), with P = L // 2 (see the module docstring). Sums are in
    float32; a missing segment sums to 0. Segment ids above 2P (never written by the packer)
    are left out."""
    num_pairs = segment_ids_BxL.shape[-1] // 2
    num_segments = 2 * num_pairs + 1  # 0 (padding), then 1 .. 2P

    def per_row(x_L, seg_L):
        sums_S = jax.ops.segment_sum(x_L, seg_L, num_segments=num_segments)
        present_S = jax.ops.segment_sum(jnp.ones_like(seg_L), seg_L, num_segments=num_segments)
        return sums_S, present_S > 0

    sums_BxS, present_BxS = jax.vmap(per_row)(x_BxL.astype(jnp.float32), segment_ids_BxL)
    chosen_BxP, rejected_BxP = sums_BxS[:, 1::2], sums_BxS[:, 2::2]
    valid_BxP = present_BxS[:, 1::2] & present_BxS[:, 2::2]
    return chosen_BxP, rejected_BxP, valid_BxP


def load_function(spec: str, key: str) -> Callable:
    """The function `MODULE:NAME` or `path/to/file.py:NAME` names; ConfigError naming `key`
    when it cannot be loaded or is not callable."""
    where, _, attr = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            if module_spec is None or not Path(where).is_file():
                raise FileNotFoundError(where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        fn = getattr(module, attr)
    except (ImportError, FileNotFoundError, AttributeError) as e:
        raise ConfigError(f"{key}={spec!r} cannot be loaded: {e}") from None
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r} is not a function")
    return fn
