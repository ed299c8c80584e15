"""The kernels package itself: the masks and masked scores every jnp attention is built on
(`jaxllm.kernels.reference`), the agreement of the references built on them (the model's XLA
path, the flash and decode references), and that `import jaxllm.kernels` loads no backend."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_inputs import inputs, packed_ids
from jaxllm.kernels import (
    MASK_VALUE,
    decode_attention_reference,
    flash_attention_reference,
    quantize_cache,
)
from jaxllm.kernels.reference import attention_mask, masked_logits, masked_scores

from jaxllm.model.attention import dot_product_attention


def _mask_by_definition(q_pos_BxL, k_pos_BxS, causal, window, q_ids_BxL, kv_ids_BxS):
    b, l = q_pos_BxL.shape
    s = k_pos_BxS.shape[1]
    mask = np.zeros((b, l, s), bool)
    for bi in range(b):
        for i in range(l):
            for j in range(s):
                q, k = q_pos_BxL[bi, i], k_pos_BxS[bi, j]
                seen = k <= q if causal else True
                if window is not None and window > 0:
                    seen = seen and q - window < k and (causal or k < q + window)
                if q_ids_BxL is not None:
                    seen = seen and q_ids_BxL[bi, i] == kv_ids_BxS[bi, j]
                mask[bi, i, j] = seen
    return mask


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("window", [None, 3, 0, "traced3", "traced0"])
@pytest.mark.parametrize("layout", ["indices", "permuted_per_row"])
@pytest.mark.parametrize("segments", [False, True], ids=["", "segments"])
def test_attention_mask_matches_definition(causal, window, layout, segments):
    """Positions shared by the batch ([L]) or per row ([B, L], a ring block's global indices);
    a window w <= 0, Python int or traced, is no window."""
    b, l, s = 2, 12, 9
    rng = np.random.default_rng(0)
    if layout == "indices":
        q_pos, k_pos = np.arange(l), np.arange(s)
        q_pos_BxL, k_pos_BxS = np.broadcast_to(q_pos, (b, l)), np.broadcast_to(k_pos, (b, s))
    else:
        q_pos = q_pos_BxL = np.stack([rng.permutation(l) for _ in range(b)])
        k_pos = k_pos_BxS = np.stack([rng.permutation(l)[:s] for _ in range(b)])
    q_ids = np.asarray(packed_ids(b, l, [5])) if segments else None
    kv_ids = np.asarray(packed_ids(b, s, [4])) if segments else None
    w = window
    if isinstance(window, str):
        w = jnp.int32(int(window[len("traced") :]))
    seg = None if q_ids is None else (jnp.asarray(q_ids), jnp.asarray(kv_ids))

    def mask(w):
        return attention_mask(
            jnp.asarray(q_pos), jnp.asarray(k_pos), causal=causal, sliding_window=w, segment_ids=seg
        )

    got = jax.jit(mask)(w) if isinstance(window, str) else mask(w)
    want = _mask_by_definition(
        q_pos_BxL, k_pos_BxS, causal, None if w is None else int(w), q_ids, kv_ids
    )
    got = np.broadcast_to(np.asarray(got), want.shape)
    np.testing.assert_array_equal(got, want)


def test_attention_mask_one_segment_array_needs_equal_lengths():
    ids = jnp.zeros((1, 4), jnp.int32)
    assert attention_mask(jnp.arange(4), jnp.arange(4), segment_ids=ids).shape == (1, 4, 4)
    with pytest.raises(ValueError, match="L == S"):
        attention_mask(jnp.arange(4), jnp.arange(6), segment_ids=ids)


@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_masked_scores_match_definition(soft_cap):
    """cap(q k^T * scale) + bias where visible, MASK_VALUE elsewhere, GQA heads g * R + r on kv
    head g; tanh(s / cap) comes back for the cap's derivative."""
    q, k, _, _ = inputs(2, 6, 5, 4, 2, 8, jnp.float32)
    mask = attention_mask(jnp.arange(6), jnp.arange(5), causal=True)
    bias = jax.random.normal(jax.random.key(3), (1, 2, 2, 6, 5))
    scores, tanh = masked_scores(q, k, mask, scale=0.3, soft_cap=soft_cap, bias=bias)
    assert scores.shape == (2, 2, 2, 6, 5) and scores.dtype == jnp.float32
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    raw = np.einsum("blhk,bshk->bhls", q64, np.repeat(k64, 2, axis=2)) * 0.3
    capped = raw if soft_cap is None else soft_cap * np.tanh(raw / soft_cap)
    want = capped.reshape(2, 2, 2, 6, 5) + np.asarray(bias)
    visible = np.broadcast_to(np.asarray(mask)[:, None, None], want.shape)
    np.testing.assert_allclose(np.asarray(scores)[visible], want[visible], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(scores)[~visible] == np.float32(MASK_VALUE))
    if soft_cap is None:
        assert tanh is None
    else:
        want_tanh = np.tanh(raw / soft_cap).reshape(want.shape)
        np.testing.assert_allclose(np.asarray(tanh), want_tanh, rtol=1e-5, atol=1e-6)
    # the same logits from the raw products in another layout (the decode reference's rows)
    rows, _ = masked_logits(
        jnp.einsum("blgrk,bsgk->bgrls", q.reshape(2, 6, 2, 2, 8), k),
        mask[:, None, None],
        scale=0.3,
        soft_cap=soft_cap,
        bias=bias,
    )
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(scores))


def test_model_flash_and_decode_references_agree():
    """The three jnp attentions on the shared reference compute the same attention: the model's
    XLA path and the flash reference with window, soft cap and packed segments; the decode
    reference, L queries over a float32 cache of the same L tokens, with window and soft cap."""
    b, l, h, g, d = 2, 24, 4, 2, 16
    q, k, v, _ = inputs(b, l, l, h, g, d, jnp.float32, seed=5)
    ids = packed_ids(b, l, [9, 15])
    masks = dict(sliding_window=7, soft_cap=3.0)
    model = dot_product_attention(q, k, v, q_segment_ids_BxL=ids, causal=True, **masks)
    flash = flash_attention_reference(q, k, v, segment_ids=ids, causal=True, **masks)
    np.testing.assert_allclose(np.asarray(model), np.asarray(flash), rtol=2e-6, atol=2e-6)

    cache = quantize_cache(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), "float32")
    lengths = jnp.full((b,), l, jnp.int32)
    decode = decode_attention_reference(q, cache, lengths, **masks)
    flash = flash_attention_reference(q, k, v, causal=True, **masks)
    np.testing.assert_allclose(np.asarray(decode), np.asarray(flash), rtol=2e-6, atol=2e-6)


def test_import_loads_no_backend():
    """`import jaxllm.kernels` imports no backend module (Triton, Mosaic TPU, Mosaic GPU) and
    nothing of jax's Pallas Mosaic GPU / Triton / TPU backends beyond what `jax.experimental.pallas`
    loads itself; a call imports the module of its backend only."""
    script = textwrap.dedent(
        """
        import functools, json, sys
        import jax, jax.numpy as jnp
        import jax.experimental.pallas
        before = set(sys.modules)
        import jaxllm.kernels
        new = sorted(set(sys.modules) - before)
        pallas_backends = ("jax._src.pallas.mosaic_gpu", "jax._src.pallas.triton",
                           "jax._src.pallas.mosaic.", "jax.experimental.pallas.mosaic_gpu",
                           "jax.experimental.pallas.triton", "jax.experimental.pallas.tpu")
        ours = [m for m in new if m.startswith("jaxllm.kernels.")]
        pallas = [m for m in new if m.startswith(pallas_backends)]
        x = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.float32)
        jax.eval_shape(functools.partial(jaxllm.kernels.flash_attention, interpret=True), x, x, x)
        after_call = sorted(m for m in sys.modules if m.startswith("jaxllm.kernels."))
        print(json.dumps(dict(ours=ours, pallas=pallas, after_call=after_call)))
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    backends = {"triton", "mosaic_tpu", "mosaic_gpu", "mosaic_gpu_backward"}
    loaded = {m.rsplit(".", 1)[-1] for m in got["ours"]}
    assert not loaded & backends, got["ours"]
    assert "jaxllm.kernels.flash_attention.ops" in got["ours"]  # the check sees the package
    assert got["pallas"] == []
    after = {m for m in got["after_call"] if m.rsplit(".", 1)[-1] in backends}
    assert after == {"jaxllm.kernels.flash_attention.mosaic_tpu"}
