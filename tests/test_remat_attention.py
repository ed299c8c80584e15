"""`model.remat=dots_attention`: each layer's attention output and logsumexp are saved by name,
so the backward pass does not run the attention forward again (`jaxllm.model.remat`). The
count is read from the compiled gradient: in interpret mode on CPU each run of the flash
kernel's forward is one loop whose instructions carry the kernel's name."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

from jaxllm.model import build
from jaxllm.model.remat import REMAT_POLICIES, save_attention


def _tokens(b, l, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, l), 0, 64)


def _grad(cfg, tokens):
    """(compiled HLO text of the gradient, the gradient) of a loss of the model's logits."""
    graphdef, params = nnx.split(build(cfg, seed=7), nnx.Param)

    def loss(p):
        return nnx.merge(graphdef, p)(tokens).logits.astype(jnp.float32).std()

    grad = jax.jit(jax.grad(loss))
    return grad.lower(params).compile().as_text(), grad(params)


def _forward_kernel_loops(hlo: str) -> int:
    """While loops the flash forward kernel runs as (interpret mode): one per run of it."""
    return len(
        re.findall(r"= [^\n]* while\([^\n]*op_name=\"[^\"]*flash_attention_fwd[^\"]*/while\"", hlo)
    )


def test_dots_attention_runs_the_flash_forward_once_and_keeps_the_gradients():
    base = tiny_model(num_layers=2, attention_impl="flash", max_seq_len=32)
    tokens = _tokens(2, 32)
    counts, grads = {}, {}
    for remat in ("none", "dots", "dots_attention"):
        hlo, grads[remat] = _grad(dataclasses.replace(base, remat=remat), tokens)
        counts[remat] = _forward_kernel_loops(hlo)
    assert counts["none"] >= 1
    assert counts["dots"] == 2 * counts["none"]  # dots: the forward again in the backward
    assert counts["dots_attention"] == counts["none"]
    for remat in ("dots", "dots_attention"):
        for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[remat])):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def _attention(q, k, v, seg):
    """A stand-in for cuDNN's fused attention (whose residuals jax.nn does not name): XLA's
    attention of packed rows, its softmax the one `exponential` of the step."""
    mask = (seg[:, None, :, None] == seg[:, None, None, :]) & jnp.tril(jnp.ones((1, 1, 8, 8), bool))
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


@pytest.mark.parametrize("remat", ["dots", "dots_attention"])
def test_save_attention_keeps_an_unnamed_kernels_residuals_under_dots_attention(remat):
    w = jax.random.normal(jax.random.key(0), (3, 16, 16))
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    seg = jnp.array([[1] * 5 + [2] * 3, [1] * 8])

    def layer(w, attention):
        q, k, v = (jnp.tanh(x @ w[i]).reshape(2, 8, 2, 8) for i in range(3))
        return jnp.sum((attention(q, k, v, seg).reshape(2, 8, 16) @ w[0]) ** 2)

    def grad(attention):
        f = jax.jit(
            jax.grad(jax.checkpoint(lambda w: layer(w, attention), policy=REMAT_POLICIES[remat]))
        )
        return f.lower(w).compile().as_text(), f(w)

    plain_hlo, plain = grad(_attention)
    saved_hlo, saved = grad(save_attention(_attention))
    exps = [len(re.findall(r"= f32\[[^\n]* exponential\(", h)) for h in (plain_hlo, saved_hlo)]
    assert exps[0] == 2  # the softmax again in the backward pass
    assert exps[1] == (1 if remat == "dots_attention" else 2)  # only named residuals are kept
    np.testing.assert_allclose(saved, plain, rtol=1e-4, atol=1e-4)  # values up to ~60


def test_the_encoder_decoder_keeps_its_gradients_under_every_policy():
    """T5 (`kind=encoder_decoder`) under each policy of `model.remat`, `auto` included (which
    outside training is no remat): the gradients of a remat-free model."""
    from test_encoder_decoder import T5

    base = tiny_model(**T5)
    ids, dec = _tokens(2, 10), _tokens(2, 6, seed=1)

    def grads(remat):
        graphdef, params = nnx.split(build(dataclasses.replace(base, remat=remat), seed=0))

        def loss(p):
            return nnx.merge(graphdef, p)(ids, dec).logits.std()

        return jax.jit(jax.grad(loss))(params)

    ref = grads("none")
    for remat in [*REMAT_POLICIES, "auto"]:
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(grads(remat))):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
