"""The rematerialisation policies of `ModelConfig.remat`, and the names that let a policy keep
attention's results.

`dots` saves every matmul's output, but the fused attention kernels (flash, cuDNN) are custom
calls, not matmuls: under `dots` the backward pass runs each layer's attention forward again
to rebuild the output that the output projection's gradient reads and the (out, lse) the
kernel's own backward reads. `dots_attention` is `dots` plus those results, saved by name
(`jax.ad_checkpoint.checkpoint_name`): the flash kernel names its output and logsumexp
(`ATTENTION_OUT`, `ATTENTION_LSE`, in `kernels/flash_attention/ops.py`), and `save_attention`
names the residuals of a kernel that does not (cuDNN's, inside `jax.nn`). On the `xla`
implementation both attention matmuls are dots already, so `dots_attention` saves what `dots`
does (the softmax is recomputed elementwise from the saved scores).

`auto` is no policy: `jaxllm.train.remat_auto` picks one of `AUTO_ORDER` for a memory budget
before the model is built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxllm.model.layers import dots_saveable

ATTENTION_OUT = "attention_out"
ATTENTION_LSE = "attention_lse"

_policies = jax.checkpoint_policies
REMAT_POLICIES = {
    "full": None,  # save nothing but the block input; recompute the block in the backward pass
    # every matmul's output, `layers.widening_einsum`'s (the xla attention scores) included
    "dots": dots_saveable,
    # dots, and each attention kernel's output and logsumexp: attention runs once per step
    "dots_attention": _policies.save_from_both_policies(
        dots_saveable, _policies.save_only_these_names(ATTENTION_OUT, ATTENTION_LSE)
    ),
    "dots_with_no_batch_dims": _policies.dots_with_no_batch_dims_saveable,
    # what dots_with_no_batch_dims saves, kept in host memory until the backward pass
    "offload": _policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}

# model.remat=auto tries these in turn, least recomputation first (`offload` moves activations
# to the host instead of recomputing them, so it is asked for by name only)
AUTO_ORDER = ("none", "dots_attention", "dots", "dots_with_no_batch_dims", "full")


def policy(name: str):
    """The `jax.checkpoint` policy of `ModelConfig.remat` value `name` (not none or auto)."""
    if name not in REMAT_POLICIES:
        raise ValueError(
            f"remat {name!r} is not one of {sorted(REMAT_POLICIES)} (auto is resolved by "
            "jaxllm train / plan before the model is built)"
        )
    return REMAT_POLICIES[name]


def save_attention(fn):
    """`fn(*arrays) -> out` whose differentiation saves by name what its backward pass reads:
    `out` as `ATTENTION_OUT`, and every other floating residual that is not one of the inputs
    (a kernel's logsumexp or statistics) as `ATTENTION_LSE`. Without a policy naming them the
    names change nothing; the gradient is `fn`'s own."""

    @jax.custom_vjp
    def saved(*args):
        return checkpoint_name(fn(*args), ATTENTION_OUT)

    def fwd(*args):
        out, pullback = jax.vjp(fn, *args)
        named_out = checkpoint_name(out, ATTENTION_OUT)
        leaves, tree = jax.tree.flatten(pullback)

        def name(leaf):
            if leaf is out:
                return named_out
            if any(leaf is a for a in args) or not jnp.issubdtype(leaf.dtype, jnp.inexact):
                return leaf  # the inputs are the caller's to keep or recompute
            return checkpoint_name(leaf, ATTENTION_LSE)

        return named_out, jax.tree.unflatten(tree, [name(leaf) for leaf in leaves])

    def bwd(pullback, cotangent):
        return pullback(cotangent)

    saved.defvjp(fwd, bwd)
    return saved
