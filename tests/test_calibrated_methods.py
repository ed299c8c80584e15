"""The calibrated quantization methods against NumPy re-derivations of their papers: GPTQ
(Frantar et al. 2022, as the authors' and AutoGPTQ's reference code computes it, blocks and
group quirk included) and AWQ's scale search; GPTQ with an identity Hessian is RTN; AWQ's
folded scales leave the float model's function unchanged; the statistics `tap` records."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_RUN

import jaxllm
from jaxllm.cli import main
from jaxllm.compress import awq, gptq
from jaxllm.config import Config, QuantizeConfig
from jaxllm.config.quantize import AWQConfig
from jaxllm.model import coded, quantized, tap


def np_grid(w, bits, symmetric):
    """(scale, zero) of the rows of w [g, N] per output column, as RTN's."""
    top = 2**bits - 1
    if symmetric:
        s = np.abs(w).max(0) * np.float32(2 / top)
        z = np.full_like(s, 2 ** (bits - 1))
    else:
        lo, hi = np.minimum(w.min(0), 0), np.maximum(w.max(0), 0)
        s = (hi - lo) * np.float32(1 / top)
    s = np.where(s == 0, np.float32(1), s).astype(np.float32)
    if not symmetric:
        z = np.clip(np.round(-lo * (np.float32(1) / s)), 0, top)
    return s, z


def np_gptq(w, h, bits, group, symmetric, block, damp, act_order, static_groups):
    """The reference algorithm (GPTQ's `fasterquant`) in float64, on W [K, N] (our rows are
    its columns). Returns the codes [K, N]."""
    w, h = w.astype(np.float64).copy(), h.astype(np.float64).copy()
    k, n = w.shape
    g = group or k
    top = 2**bits - 1
    grids = [np_grid(w[i : i + g].astype(np.float32), bits, symmetric) for i in range(0, k, g)]
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[dead] = 0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    w, h = w[perm], h[perm][:, perm]
    h += np.eye(k) * damp * np.mean(np.diag(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    codes = np.zeros((k, n))
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, e1 = w[i1:i2].copy(), np.zeros((i2 - i1, n))
        for i in range(i2 - i1):
            col = i1 + i
            if group and not static_groups and col % g == 0:  # from W as of the block start
                grids[col // g] = np_grid(w[col : col + g].astype(np.float32), bits, symmetric)
            s, z = grids[perm[col] // g]
            s64 = s.astype(np.float64)
            q = np.clip(np.round(w1[i] * (1 / s64)) + z, 0, top)
            err = (w1[i] - (q - z) * s64) / u[col, col]
            w1[i:] -= np.outer(u[col, col:i2], err)
            codes[col], e1[i] = q, err
        w[i2:] -= u[i1:i2, i2:].T @ e1
    return codes[np.argsort(perm)]


CASES = {  # name -> (bits, group, symmetric, act_order, static_groups)
    "int4 per channel": (4, 0, True, False, False),
    "int3 groups": (3, 16, False, False, False),
    "int4 groups act order": (4, 16, True, True, True),
    "int2 static groups": (2, 40, True, False, True),
    "int8 act order": (8, 0, False, True, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gptq_matches_the_reference(case):
    bits, group, symmetric, act_order, static = CASES[case]
    rng = np.random.default_rng(len(case))
    k, n = 80, 24  # K not a multiple of the block: the last block is padded
    w = rng.normal(0, 0.05, (k, n)).astype(np.float32)
    x = rng.normal(0, 1, (256, k)) * rng.uniform(0.2, 3, k)  # uneven channel energies
    x[:, 3] = 0  # a channel no input reaches
    h = (x.T @ x).astype(np.float32)
    got = gptq.solve(
        jnp.asarray(w),
        jnp.asarray(h),
        bits=bits,
        group=group,
        symmetric=symmetric,
        dtype=jnp.float32,
        block=32,
        damp=0.01,
        act_order=act_order,
        static_groups=static,
    )[0]
    want = np_gptq(w, h, bits, group, symmetric, 32, 0.01, act_order, static)
    same = np.mean(np.asarray(got) == want)
    assert same > 0.995, same  # float32 vs float64: a rare tie rounds the other way


@pytest.mark.parametrize("group, symmetric", [(0, True), (16, False)])
def test_gptq_with_an_identity_hessian_is_rtn(group, symmetric):
    w = np.random.default_rng(0).normal(0, 0.05, (2, 64, 24)).astype(np.float32)
    cfg = QuantizeConfig(method="gptq", bits=3, group_size=group, symmetric=symmetric)
    stats = {"gram": jnp.broadcast_to(jnp.eye(64), (2, 64, 64))}
    got = gptq.gptq(jnp.asarray(w), stats, cfg, n_in=1, n_out=1)
    want = quantized.quantize(
        jnp.asarray(w), bits=3, group=group, symmetric=symmetric, n_in=1, n_out=1
    )
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), got, want))


def test_tap_records_gram_magnitudes_and_counts():
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 4))  # [b, l, heads, head_dim]
    kernel = jnp.ones((3, 4, 6))
    mask = jnp.asarray([1.0] * 7 + [0.0] * 3)
    with tap.recording({id(kernel): "o"}, mask) as rec:
        tap.active().see("blhk,hkd->bld", x, kernel)
    rows = np.asarray(x).reshape(10, 12)[:7]
    s = rec.stats["o"]
    np.testing.assert_allclose(s["gram"], rows.T @ rows, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s["abs_sum"], np.abs(rows).sum(0), rtol=1e-5)
    np.testing.assert_allclose(s["abs_max"], np.abs(rows).max(0), rtol=1e-6)
    assert float(s["count"]) == 7


def np_awq_scales(ws, hs, mean, bits, grid, duo):
    """AWQ's search: the scales of least sum tr(dW^T H dW) over s = 1 and alpha in [0, 1)."""
    best, out = np.inf, None
    for i in range(-1, grid):
        a = i / grid
        s = mean**a
        if duo:
            wm = sum(
                (np.abs(w) / (np.abs(w).max(0, keepdims=True) + 1e-6)).mean(1) for w in ws
            ) / len(ws)
            s = s / (wm ** (1 - a) + 1e-4)
        s = np.maximum(s, 1e-4)
        s = s / np.sqrt(s.max() * s.min()) if i >= 0 else np.ones_like(mean)
        loss = 0.0
        for w, h in zip(ws, hs):
            ws_ = (w * s[:, None]).astype(np.float32)
            sc, z = np_grid(ws_, bits, True)
            q = np.clip(np.round(ws_ * (np.float32(1) / sc)) + z, 0, 2**bits - 1)
            dw = w - (q - z) * sc / s[:, None]
            loss += np.sum(dw * (h @ dw))
        if loss < best:
            best, out = loss, s
    return out


@pytest.mark.parametrize("duo", [False, True])
def test_awq_search_matches_numpy(duo):
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (512, 32)) * rng.uniform(0.1, 8, 32)
    ws = [rng.normal(0, 0.05, (32, 16)).astype(np.float32) for _ in range(2)]
    h = (x.T @ x).astype(np.float32)
    mean = np.abs(x).mean(0).astype(np.float32)
    q = QuantizeConfig(method="awq", bits=3, awq=AWQConfig(grid=10, duo_scaling=duo))
    got = awq._search(tuple(map(jnp.asarray, ws)), (h, h), jnp.asarray(mean * 512), 512.0, q, True)
    want = np_awq_scales(ws, [h, h], mean, 3, 10, duo)
    np.testing.assert_allclose(got, want, rtol=1e-4)


def np_awq_clip(w, h, bits, group, symmetric):
    """AWQ's clip search (AutoAWQ's `auto_clip_layer`) on W [K, N]: per (group, output), the
    clip ratio in 1, 0.95, ..., 0.55 of least tr(dW^T H_gg dW); returns the clipped W."""
    out = w.copy()
    for g in range(0, w.shape[0], group):
        wg, hg = w[g : g + group], h[g : g + group, g : g + group].astype(np.float64)
        amax = np.abs(wg).max(0)
        best = np.full(w.shape[1], np.inf)
        for r in 1 - np.arange(10) / 20:
            m = (amax * np.float32(r)).astype(np.float32)
            c = np.clip(wg, -m, m)
            sc, z = np_grid(c, bits, symmetric)
            q = np.clip(np.round(c * (np.float32(1) / sc)) + z, 0, 2**bits - 1)
            d = (wg - (q - z) * sc).astype(np.float64)
            err = np.einsum("in,ij,jn->n", d, hg, d)
            better = err < best
            best[better], out[g : g + group, better] = err[better], c[:, better]
    return out


@pytest.mark.parametrize("group,symmetric", [(0, True), (8, False)])
def test_awq_clip_matches_numpy(group, symmetric):
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1, (256, 32)) * rng.uniform(0.1, 4, 32)
    w = rng.standard_t(3, (32, 16)).astype(np.float32) * 0.05  # heavy tails: clipping pays
    h = (x.T @ x).astype(np.float32)
    q = QuantizeConfig(method="awq", bits=3, group_size=group, symmetric=symmetric)
    got = np.asarray(awq._clip(jnp.asarray(w), jnp.asarray(h), None, q))
    want = np_awq_clip(w, h, 3, group or 32, symmetric)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert not np.array_equal(got, w)  # some groups were clipped
    s = rng.uniform(0.5, 2, 32).astype(np.float32)  # rows already times s: inputs over s
    got = awq._clip(jnp.asarray(w * s[:, None]), jnp.asarray(h), jnp.asarray(s), q)
    want = np_awq_clip(w * s[:, None], h / s[:, None] / s[None, :], 3, group or 32, symmetric)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_awq_folds_keep_the_float_function():
    """Readers' rows times s and the producers divided by s: the same block output (norm
    with LayerNorm bias and offset, up -> down, MHA v -> o, an MoE router and experts)."""
    from flax import nnx

    from jaxllm.config import ModelConfig, MoEConfig
    from jaxllm.model.transformer import build

    mcfg = ModelConfig(
        num_layers=2,
        d_model=32,
        mlp_dim=64,
        num_heads=4,
        num_kv_heads=4,
        vocab_size=64,
        dtype="float32",
        norm="layernorm",
        norm_offset=1.0,
        moe=MoEConfig(num_experts=4, num_shared_experts=1, first_dense_layers=1),
    )
    model = build(mcfg, 0)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    want = model(tokens).logits
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    cfg = Config(model=mcfg)
    rng = np.random.default_rng(0)

    def fold_all(block):
        for producer, readers, kind in awq.sets(block, cfg):
            lead, n_in = awq._in_dims(block, readers[0])
            w = awq._get(block, readers[0])
            shape = (() if kind == "norm" else w.shape[:lead]) + (
                int(np.prod(w.shape[lead : lead + n_in])),
            )
            s = jnp.asarray(rng.uniform(0.5, 2.0, shape), jnp.float32)
            for r in readers:
                awq._set(block, r, awq._scale_rows(awq._get(block, r), s, *awq._in_dims(block, r)))
            awq._fold(block, producer, kind, s, cfg)
        return block

    for parent, name in ((params, "layers"), (params["moe_layers"], "moe")):
        block = fold_all(jax.tree.map(lambda a: a[0], parent[name]))
        parent[name] = jax.tree.map(lambda a: a[None], block)
    kinds = {kind for _, _, kind in awq.sets(jax.tree.map(lambda a: a[0], params["layers"]), cfg)}
    assert kinds == {"norm", "columns"}
    params = fold_all(params)  # the final norm and the LM head
    got = nnx.merge(graphdef, params, rest)(tokens).logits
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.fixture(scope="module")
def moe_mla_run(tmp_path_factory):
    """A SMALL_RUN with MLA attention and MoE layers (routed and shared experts, a dense first
    layer) trained 2 steps."""
    run = tmp_path_factory.mktemp("moe_mla") / "run"
    arch = [
        "model.moe.num_experts=4",
        "model.moe.num_shared_experts=1",
        "model.moe.first_dense_layers=1",
        "model.mla.kv_lora_rank=16",
        "model.mla.q_lora_rank=12",
        "model.mla.qk_nope_head_dim=8",
        "model.mla.qk_rope_head_dim=4",
        "model.mla.v_head_dim=6",
        "model.num_kv_heads=4",
    ]
    argv = ["train", *SMALL_RUN, *arch, "train.steps=2", "checkpoint.every=2", f"run.dir={run}"]
    assert main(argv) == 0
    return run


@pytest.mark.parametrize(
    "method",
    [
        pytest.param("gptq", marks=pytest.mark.slow),
        pytest.param("awq", marks=pytest.mark.slow),
        pytest.param("smoothquant", marks=pytest.mark.slow),
    ],
)
def test_calibrated_methods_cover_experts_and_mla(moe_mla_run, tmp_path, method):
    """Every projection of an MLA + MoE model, the experts' and MLA's included, and the LM head
    (last, with AWQ its scales folded into the final norm) are quantized, and the logits stay
    near the float model's."""
    tokens = np.arange(32).reshape(2, 16) * 7 % 320
    want = np.asarray(jaxllm.load_model(moe_mla_run)(tokens).logits)
    out = tmp_path / method
    argv = ["quantize", str(moe_mla_run), str(out), "--method", method, "--bits", "8"]
    assert main([*argv, "--samples", "8", "quantize.head=true"]) == 0
    model = jaxllm.load_model(out)
    assert isinstance(model.lm_head.get_value(), (quantized.QuantizedTensor, coded.CodedTensor))
    moe = model.moe_layers.moe
    for w in (moe.mlp.gate_proj, moe.mlp.shared.down_proj, moe.attn.kv_b_proj):
        assert isinstance(w.get_value(), (quantized.QuantizedTensor, coded.CodedTensor))
    assert isinstance(model.layers.attn.q_a_proj.get_value(), type(w.get_value()))
    got = np.asarray(model(tokens).logits)
    assert np.sqrt(np.mean((got - want) ** 2)) < 0.02 * np.sqrt(np.mean(want**2))


def test_tap_records_each_experts_routed_rows():
    """A MoE layer records each expert's statistics from the tokens routed to it (padding
    masked out), its down projection's from their SwiGLU, and not the dispatch buffers."""
    from flax import nnx

    from jaxllm.config import MoEConfig
    from jaxllm.model import moe as moe_lib

    moe_cfg = MoEConfig(num_experts=4, dispatch="capacity")
    opts = dict(init_std=0.5, out_std=0.5, dtype=jnp.float32, param_dtype=jnp.float32)
    layer = moe_lib.MoE(16, 32, moe_cfg, **opts, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    mask = jnp.asarray([1.0] * 8 + [0.0] * 2)
    names = {id(getattr(layer, n).get_value()): n for n in moe_lib.EXPERT_WEIGHTS}
    with tap.recording(names, mask) as rec:
        layer(x)
    r = moe_lib.route(jnp.einsum("bld,de->ble", x, layer.router[...]), None, moe_cfg)
    chosen = np.asarray(moe_lib.combine_weights(r, 4) > 0).reshape(10, 4)
    chosen = chosen * np.asarray(mask)[:, None]
    rows = np.asarray(x).reshape(10, 16)
    gate = rec.stats["gate_proj"]
    np.testing.assert_allclose(gate["count"], chosen.sum(0))
    for e in range(4):
        xe = rows[chosen[:, e] > 0]
        np.testing.assert_allclose(gate["gram"][e], xe.T @ xe, rtol=1e-5, atol=1e-5)
    assert rec.stats["down_proj"]["gram"].shape == (4, 32, 32)
