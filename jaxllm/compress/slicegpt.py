"""SliceGPT (Ashkboos et al. 2024, arXiv:2401.15024): rotate the residual stream by its
principal components, then delete the rows and columns of the least used directions, so
`model.d_model` shrinks.

A pre-norm transformer with RMSNorm computes the same function after an orthogonal Q is applied
to its residual stream, once each norm's scale gamma is folded into the weights that read the
norm's output: RMSNorm(x Q) = RMSNorm(x) Q. With x_hat = x / rms(x) and c = sqrt(d / d') (the
rms of the sliced stream is taken over d' channels, so its normalised vectors come out
sqrt(d' / d) times shorter; c gives them back their length):

    embedding         E'   = E Q_d'                    (rows of the vocabulary)
    a block's inputs  W'   = c Q_d'^T diag(gamma) W    (q/k/v_proj under its attn norm,
                                                        gate/up_proj under its mlp norm)
    a block's outputs W'   = W Q_d'                    (o_proj, down_proj, their biases)
    the LM head       H'   = c Q_d'^T diag(gamma_f) H  (from the embedding when tied)
    every norm scale  gamma' = 1

with Q_d' the first d' = d - floor(S d) eigenvectors (by decreasing eigenvalue) of the
calibration Gram matrix of the normalised stream, sum over tokens and layers of x_hat^T x_hat
(each layer's attention and MLP inputs, recovered from the recorded inputs gamma * x_hat).
Deleting the other d - d' directions is the only approximation: at S = 0 the rotated model's
logits are the original's to float rounding (tests/test_prune.py).

One Q serves the whole stream. The paper rotates each block by its own Q_l and puts
Q_l^T Q_(l+1) on every residual connection, which a plain transformer has no weight for; the
one rotation keeps the pruned model an ordinary run (a smaller d_model) that exports to Hugging
Face, at the cost of the per-layer fit.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

NORMS = {"attn": "attn_norm", "mlp": "mlp_norm"}
# (the weights that read a norm's output, the first present; the norm)
READERS = ((("attn/q_proj",), "attn_norm"), (("mlp/gate_proj", "mlp/up_proj"), "mlp_norm"))


def rotation(grams: list[tuple[np.ndarray, np.ndarray]], keep: int) -> np.ndarray:
    """Q_d' [d, keep]: the leading eigenvectors of sum_i diag(1/g_i) G_i diag(1/g_i) over
    `grams` = [(G_i [d, d], g_i [d])], the Gram matrices of gamma_i * x_hat with gamma_i their
    norm scales; in float64."""
    d = grams[0][0].shape[0]
    total = np.zeros((d, d))
    for g, gamma in grams:
        inv = 1.0 / np.where(gamma == 0, 1.0, np.asarray(gamma, np.float64))
        total += inv[:, None] * np.asarray(g, np.float64) * inv[None, :]
    values, vectors = np.linalg.eigh((total + total.T) / 2)
    return vectors[:, np.argsort(values)[::-1][:keep]]


def _rotate_in(w, axes, q, gamma, c):
    """c Q^T diag(gamma) W over the `embed` axis of w; gamma [d], or [L, d] for a stack's
    weights [L, ...]."""
    u = axes.index("embed")
    w = jnp.moveaxis(w.astype(jnp.float32), u, -1)  # [..., d]
    lead = gamma.shape[:1] if gamma.ndim > 1 else ()
    gamma = gamma.reshape(lead + (1,) * (w.ndim - 1 - len(lead)) + gamma.shape[-1:])
    return jnp.moveaxis(c * ((w * gamma) @ q), -1, u)


def _rotate_out(w, axes, q):
    """W Q over the `embed` axis of w."""
    u = axes.index("embed")
    return jnp.moveaxis(jnp.moveaxis(w.astype(jnp.float32), u, -1) @ q, -1, u)


def _leaves(tree, axes, q, gamma, c):
    """A block part's weights: those writing the stream (`embed` last) rotated out, those
    reading it rotated in with the part's norm scale `gamma`, the rest as they are."""
    if isinstance(tree, dict):
        return {k: _leaves(v, axes[k], q, gamma, c) for k, v in tree.items()}
    if "embed" not in axes:
        return tree
    if axes[-1] == "embed":
        return _rotate_out(tree, axes, q).astype(tree.dtype)
    return _rotate_in(tree, axes, q, gamma, c).astype(tree.dtype)


def slice_params(params: dict, axes: dict, q: np.ndarray, *, offset: float, tied: bool) -> dict:
    """The model's parameters rotated by Q_d' `q` [d, d'] and sliced (module docstring); norm
    scales set to 1 - `offset` (Gemma-style norms store scale - 1). With `tied`, the LM head
    is made from the embedding and returned as `lm_head`. Dtypes are kept."""
    d, keep = q.shape
    c = math.sqrt(d / keep)
    qj = jnp.asarray(q, jnp.float32)

    def ones(x):
        return {"scale": jnp.full(x["scale"].shape[:-1] + (keep,), 1.0 - offset, x["scale"].dtype)}

    final = params["final_norm"]["scale"].astype(jnp.float32) + offset
    out: dict = {}
    for name, sub in params.items():
        if name == "embed":
            out[name] = {"embedding": _leaves(sub["embedding"], ("vocab", "embed"), qj, None, c)}
        elif name == "final_norm":
            out[name] = ones(sub)
        elif name == "lm_head":
            out[name] = _leaves(sub, axes[name], qj, final, c)
        elif isinstance(sub, dict) and "attn_norm" in sub:
            block = {}
            for part, v in sub.items():
                if part in NORMS.values():
                    block[part] = ones(v)
                else:
                    gamma = sub[NORMS[part]]["scale"].astype(jnp.float32) + offset
                    block[part] = _leaves(v, axes[name][part], qj, gamma, c)
            out[name] = block
        else:
            out[name] = sub
    if tied:
        e = params["embed"]["embedding"]
        out["lm_head"] = _leaves(e.T, ("embed", "vocab"), qj, final, c)
    return out
