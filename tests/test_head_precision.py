"""A bfloat16 step runs the LM head's forward and both gradient matmuls with bfloat16 operands
(float32 accumulation): `layers.widening_einsum` casts the float32 logits' cotangent first."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx
from test_loss_chunks import _cfg, _steps

from jaxllm import config, sharding
from jaxllm.config import PeftConfig
from jaxllm.model import build, dot_product, layers
from jaxllm.objectives import next_token
from jaxllm.plan import lower_step

PRESET = "configs/runs/llama3_2_1b_h100.yaml"
_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]")
_PARAM = re.compile(r"%?([\w.\-]+): (\w+)\[([\d,]*)\]")


def dot_operands(hlo: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """(dtype, shape) of both operands of every `dot` in an optimized HLO module's text."""
    dots, types = [], {}
    for line in hlo.splitlines():
        if line.startswith(("%", "ENTRY")):  # a computation's header: its parameters
            types = {n: (t, d) for n, t, d in _PARAM.findall(line.split("->")[0])}
        if m := _DEF.match(line):
            types[m.group(1)] = (m.group(2), m.group(3))
        if m := re.search(r" dot\(%([^,]+), %([^)]+)\)", line):
            ops = [types[o] for o in m.groups()]
            dots.append([(t, tuple(int(x) for x in d.split(",") if x)) for t, d in ops])
    return dots


def test_dot_operands_parser():
    hlo = """%fused (param_0: bf16[4,8], param_1: f32[8,9]) -> f32[4,9] {
  %param_0 = bf16[4,8]{1,0} parameter(0)
  %c = f32[8,9]{1,0} convert(%param_0.1)
  ROOT %dot.1 = f32[4,9]{1,0} dot(%param_0, %c), lhs_contracting_dims={1}
}"""
    assert dot_operands(hlo) == [[("bf16", (4, 8)), ("f32", (8, 9))]]


@pytest.mark.parametrize(
    "overrides",
    [(), ("model.num_layers=2", "model.tie_embeddings=false", "train.loss_chunks=8")],
    ids=["preset-tied", "untied-chunked"],
)
def test_1b_step_runs_no_float32_vocab_dots(overrides):
    """Every dot of the 1B preset's compiled step with a vocabulary-sized operand (the head's
    forward and its two gradient matmuls) takes bfloat16 operands (before `widening_einsum`
    both gradient matmuls took float32 ones), and so does every dot of the program, attention
    on `xla` (what `auto` picks on a CPU; cuDNN's on a GPU is its own) included."""
    cfg = config.load(PRESET, ["model.attention_impl=xla", *overrides])
    mesh = sharding.make_mesh(cfg.validate(1).mesh, jax.devices()[:1])
    lowered = lower_step(cfg, mesh)[0]
    # the program: no dot_general takes a float32 operand (the head's, attention's q . k and
    # their gradients included); XLA:CPU then runs bf16 -> bf16 dots in float32, so the
    # compiled module is read for the [*, V] dots, bf16 -> float32, alone
    operands = re.findall(
        r"stablehlo.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", lowered.as_text()
    )
    assert operands and not [ops for ops in operands if any("xf32>" in o for o in ops)]
    hlo = lowered.compile().as_text()
    vocab = [ops for ops in dot_operands(hlo) if any(cfg.model.vocab_size in s for _, s in ops)]
    assert len(vocab) >= 3, vocab  # the forward, d(hidden) and d(head)
    assert all(t == "bf16" for ops in vocab for t, _ in ops), vocab


def _grads(model_cfg, batch, peft=None, plain=False, chunks=1):
    """Gradients of the next-token loss for the trainable leaves; `plain`: through jax's own
    transpose of the float32-output einsums (the float32 gradient matmuls of the head and of
    attention's q . k)."""
    gd, params, rest = nnx.split(build(model_cfg, 0, peft), nnx.Param, ...)

    def loss(p):
        return next_token(0.0, loss_chunks=chunks)(nnx.merge(gd, p, rest), batch, None).loss_sum

    with pytest.MonkeyPatch.context() as mp:
        if plain:
            for module in (layers, dot_product):
                mp.setattr(module, "widening_einsum", _plain_einsum)
        return jax.tree.leaves(jax.jit(jax.grad(loss))(params))


def _plain_einsum(spec, x, kernel):
    return jnp.einsum(spec, x, kernel, preferred_element_type=jnp.float32)


def _batch(b=4, l=32, vocab=512):
    rng = np.random.default_rng(0)
    return {
        "inputs": jnp.asarray(rng.integers(0, vocab, (b, l)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, vocab, (b, l)), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l)),
        "segment_ids": jnp.ones((b, l), jnp.int32),
        "loss_mask": jnp.ones((b, l), jnp.int32),
    }


def _rel(a, b):
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def test_widening_einsum_forward_and_gradients():
    """The forward is the plain einsum's, bit for bit; the gradients are within bfloat16's
    rounding of the float32 reference's: the cotangent is rounded once (relative error at most
    2^-9 per element) before float32-accumulated sums, so the error is of the order of 2^-9
    times the norm, as the plain transpose's rounding of its output to bfloat16 is."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 16, 64), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (64, 1000), jnp.float32).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (2, 16, 1000), jnp.float32)
    spec = "bld,dv->blv"
    y, vjp = jax.vjp(lambda a, b: layers.widening_einsum(spec, a, b), x, w)
    y_plain, vjp_plain = jax.vjp(
        lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32), x, w
    )
    np.testing.assert_array_equal(y, y_plain)
    assert y.dtype == jnp.float32
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    want = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), x32, w32)[1](g)
    for got, plain, ref in zip(vjp(g), vjp_plain(g), want, strict=True):
        assert got.dtype == jnp.bfloat16
        assert _rel(got.astype(jnp.float32), ref) < 2**-7
        assert _rel(got.astype(jnp.float32), plain.astype(jnp.float32)) < 2**-7


HEADS = {
    "untied": (dict(tie_embeddings=False, final_soft_cap=30.0), None, 1),
    "tied": (dict(tie_embeddings=True), None, 1),
    "chunked": (dict(tie_embeddings=False), None, 4),
    "lora-head": (dict(tie_embeddings=False), PeftConfig(targets=("q_proj", "lm_head")), 1),
}


@pytest.mark.parametrize("name", list(HEADS))
def test_bfloat16_gradients_stay_close_and_float32_is_unchanged(name):
    """A tiny bfloat16 model's gradients stay as close to the float32 model's as they were
    with float32 gradient matmuls at the head: the bfloat16 model's own rounding puts them
    0.4-0.9% (relative norm) away; rounding the head's cotangent to bfloat16 adds at most its
    unit roundoff 2^-9 per element, so each leaf may move at most 2^-8 further. A float32 model
    takes the plain einsum: its gradients are unchanged bit for bit."""
    model, peft, chunks = HEADS[name]
    peft = peft and PeftConfig(method="lora", targets=peft.targets)
    batch = _batch()
    bf16 = tiny_model(vocab_size=512, dtype="bfloat16", **model)
    f32 = tiny_model(vocab_size=512, **model)
    new = _grads(bf16, batch, peft, chunks=chunks)
    old = _grads(bf16, batch, peft, plain=True, chunks=chunks)
    ref = _grads(f32, batch, peft, chunks=chunks)
    for got, was, want in zip(new, old, ref, strict=True):
        if not jnp.any(want):  # LoRA's A starts where its gradient is zero
            assert not jnp.any(got)
            continue
        assert _rel(got, want) <= _rel(was, want) + 2**-8
    f32_new = _grads(f32, batch, peft, chunks=chunks)
    f32_old = _grads(f32, batch, peft, plain=True, chunks=chunks)
    for a, b in zip(f32_new, f32_old, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # ~40 s: the head's custom VJP split over the vocabulary and pipeline stages
def test_bfloat16_head_sharded_and_pipelined_matches_one_device():
    """With the head's vocabulary split over `tensor` and the loss on the last of two pipeline
    stages, a bfloat16 model's chunked loss follows one device's over two steps (within 1e-4:
    they differ by the order of bfloat16 partial sums only; measured 3e-6)."""

    def bf16(cfg):
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))

    want, _ = _steps(bf16(_cfg(1)), jax.devices()[:1])
    for mesh in (dict(data=2, fsdp=2, tensor=2), dict(stage=2, data=2, tensor=2)):
        cfg = bf16(_cfg(4, **mesh))
        if mesh.get("stage"):
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=4))
        got, _ = _steps(cfg, jax.devices())
        np.testing.assert_allclose(got, want, rtol=1e-4)


@pytest.mark.parametrize("remat,computed", [("dots", 1), ("full", 2)])
def test_remat_dots_saves_the_widened_attention_scores(remat, computed):
    """xla attention's bfloat16 q . k is a custom_vjp, not a dot: remat `dots` saves its float32
    scores by name as it saved the dot's, so the backward does not compute them again (`full`
    does: the count sees a recompute)."""
    overrides = ["model.num_layers=2", "model.attention_impl=xla", "data.seq_len=512"]
    cfg = config.load(PRESET, [*overrides, f"model.remat={remat}"])
    mesh = sharding.make_mesh(cfg.validate(1).mesh, jax.devices()[:1])
    text = lower_step(cfg, mesh)[0].as_text()
    scores = r"stablehlo.dot_general .*-> tensor<\w*x512x512x\w*xf32>"
    assert len(re.findall(scores, text)) == computed
