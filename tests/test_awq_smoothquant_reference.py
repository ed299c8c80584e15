"""jaxllm's AWQ and SmoothQuant against llm-compressor's (vLLM's compressor) `AWQModifier` and
`SmoothQuantModifier`: the same tiny Llama, built by transformers and imported by jaxllm's own
Hugging Face conversion, calibrated on the same token rows by `calibrate.quantize_calibrated`
and by llm-compressor's `oneshot`, compared weight by weight. Runs in its own environment:
`make test-reference`.

The model: one float32 Llama block (d_model 96, MLP 160, three heads of 32; MHA, and GQA with
one KV head), its weights perturbed, with uneven channels (both norms' weights and the v / up
projections' output rows times U(0.3, 2), three channels of each times 8) so that the searches
have clear winners; 16 rows of 32 random tokens, which replace jaxllm's calibration rows and
are llm-compressor's batches (one row each, sequential pipeline). One block, because jaxllm's
sequential calibration gives a block the output of the quantized blocks before it (GPTQ's
scheme) and llm-compressor's pipeline (quantization disabled) that of the float ones.

AWQ (`AWQModifier`, then `QuantizationModifier`'s RTN with the min-max observer) against
`--method awq` at int4 with a zero point, groups of 32 (MHA: q/k/v, v -> o, gate/up,
up -> down) or per channel (GQA, no v -> o in either), with and without duo scaling. Compared:
the norms the q/k/v and gate/up sets' scales were folded into (relative 1e-5), and per weight
the grid (scales within 32 float32 ulps, zero points equal) and the codes (at least 99.9%
equal, any other within one step), which settle the up -> down and v -> o sets' scales too. A
different alpha anywhere moves a norm by a percent or more and a third of a weight's codes.
Measured: norms within 4e-7, scales within 5 ulps, every code and zero point equal. Where the
libraries differ, jaxllm's options or the test's inputs match llm-compressor:
- No clip search in llm-compressor's AWQ (AutoAWQ's `apply_clip`): `quantize.awq.clip=false`.
- The alpha grid: llm-compressor 0.14 tries s = 1, then alpha = i / (n_grid - 2) for
  i <= n_grid - 2 (1 included); jaxllm (the paper's and AutoAWQ's) s = 1, then alpha = i / grid
  for i < grid. llm-compressor is given jaxllm's 21 candidates (`_get_grid_search_params`).
- The loss: llm-compressor's mean squared error of the parent module's output, jaxllm's sum of
  squares of the same outputs (tr(dW^T X^T X dW) for up -> down and v -> o): the same argmin.
- Symmetric grids are left out of the whole-model comparison: with compressed-tensors' (and
  jaxllm's) scale absmax / (2^(b-1) - 1/2) every group's largest weight lies on a rounding tie,
  whose side (half a step either way) float32 decides, torch's w / s and jaxllm's w * (1 / s)
  each their own way. On a block like this one that moves the search's losses by up to 5%, more
  than the gap between neighbouring alphas. The duo-scaling weight means that feed the
  candidates, which do not depend on the grid, are compared directly with llm-compressor's
  `_compute_layer_means` (unequal readers and a stack of experts).
- CPU: llm-compressor pins its cached activations (`IntermediatesCache.pin_memory`), which torch
  refuses without an accelerator; there the test makes it a no-op (pinning moves no value).

SmoothQuant (`SmoothQuantModifier`, alpha 0.5) against `--method smoothquant`: the norms divided
by s (relative 1e-5) and every weight's int8 codes and scales, q/k/v and gate/up smoothed, o and
down not, against llm-compressor's smoothed float weights on jaxllm's grid (scale absmax / 127,
relative 1e-5; codes at least 99.9% equal, any other within one step). Measured: norms and
scales within 5e-7, at least 99.98% of each weight's codes equal (the others one step off, a
w / s within float32 of a half). The differences:
- The statistic: the paper (and jaxllm) s = max|x|^a / max|w|^(1-a); llm-compressor the range
  (max x - min x)^a / (2 max|w|)^(1-a). The model test gives llm-compressor the paper's statistic
  (its recorded range made [-max|x|, max|x|]). The scales test calls `_calculate_smoothing_scales`
  with the range 2 max|x|: equal at alpha 0.5, and a factor 2^(2a - 1) on every s otherwise,
  which per-channel int8 weights and per-token int8 activations do not see.
- Floors: jaxllm floors max|x| and max|w| at 1e-5; the paper's code max|w| and s; llm-compressor
  s (and takes s = range where max|w| = 0). Only channels below 1e-5 differ; none here.
- The int8 grid: jaxllm's scale is absmax / 127, compressed-tensors' absmax / 127.5; so jaxllm's
  codes are compared with llm-compressor's smoothed float weights, not a `QuantizationModifier`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import sharding
from jaxllm.compress import awq, calibrate, smoothquant
from jaxllm.convert.hf import load_params, model_config
from jaxllm.load import abstract_model
from jaxllm.model import quantized

pytestmark = pytest.mark.reference

D, F, HEADS, VOCAB = 96, 160, 3, 320
ROWS, L = 16, 32
GRID = 20  # jaxllm's quantize.awq.grid (its default, the paper's)
LINEARS = {  # jaxllm's path -> the HF block's module
    "attn/q_proj": "self_attn.q_proj",
    "attn/k_proj": "self_attn.k_proj",
    "attn/v_proj": "self_attn.v_proj",
    "attn/o_proj": "self_attn.o_proj",
    "mlp/gate_proj": "mlp.gate_proj",
    "mlp/up_proj": "mlp.up_proj",
    "mlp/down_proj": "mlp.down_proj",
}
NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
AWQ_CASES = {  # name -> (kv heads, group, duo scaling)
    "int4 groups of 32": (3, 32, True),
    "int4 per channel, GQA": (1, 0, True),
    "int4 groups of 32, no duo scaling": (3, 32, False),
}


def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, (ROWS, L))


def save_llama(path, kv_heads: int):
    """A one-block float32 Llama with uneven channels (module docstring), saved at `path`."""
    import torch
    import transformers as hf

    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    cfg = hf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    model = hf.LlamaForCausalLM(cfg).eval()
    block = model.model.layers[0]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for w in (
            block.input_layernorm.weight,
            block.post_attention_layernorm.weight,
            block.self_attn.v_proj.weight,
            block.mlp.up_proj.weight,
        ):
            g = rng.uniform(0.3, 2, len(w))
            g[rng.choice(len(w), 3, replace=False)] *= 8
            w.mul_(torch.tensor(g, dtype=torch.float32).reshape(-1, *[1] * (w.ndim - 1)))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """kv heads -> the saved model's directory, made once per module."""
    made = {}

    def get(kv_heads: int):
        if kv_heads not in made:
            made[kv_heads] = save_llama(tmp_path_factory.mktemp(f"llama-kv{kv_heads}"), kv_heads)
        return made[kv_heads]

    return get


def jaxllm_block(src, overrides, monkeypatch) -> dict:
    """The block's parameters (NumPy leaves) after jaxllm's calibrated quantization of the HF
    model at `src` on `tokens()`, on one device."""
    cfg = model_config(src, ["model.dtype=float32", f"quantize.samples={ROWS}", *overrides])
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    params, state, _ = load_params(src, cfg.model, mesh)
    t = tokens().astype(np.int32)
    rows = {
        "inputs": t,
        "positions": np.broadcast_to(np.arange(L, dtype=np.int32), t.shape).copy(),
        "segment_ids": np.ones_like(t),
    }
    monkeypatch.setattr(calibrate, "calibration_rows", lambda cfg, section=None: rows)
    out = calibrate.quantize_calibrated(params, state, abstract_model(cfg.model)[2], cfg, mesh)
    return jax.tree.map(lambda a: np.asarray(a[0]), out["layers"])


def llm_compressor(src, recipe, monkeypatch):
    """The HF model at `src`'s block after llm-compressor's `oneshot` with `recipe` on
    `tokens()`."""
    # Imported here: llm-compressor lives in the reference environment only, and the default
    # suite collects this module (then deselects its tests by marker).
    import torch
    import transformers as hf
    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from torch.utils.data import DataLoader

    if not torch.accelerator.is_available():
        monkeypatch.setattr(IntermediatesCache, "pin_memory", lambda self, *a, **k: None)
    rows = [
        {"input_ids": torch.tensor(t), "attention_mask": torch.ones(L, dtype=torch.long)}
        for t in tokens()
    ]
    # oneshot wants a processor even for rows given as token ids: a placeholder
    tok = hf.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    )
    model = hf.LlamaForCausalLM.from_pretrained(src).eval()
    oneshot(
        model=model,
        processor=tok,
        dataset=DataLoader(rows, batch_size=1),
        recipe=recipe,
        num_calibration_samples=ROWS,
        pipeline="sequential",
    )
    return model.model.layers[0]


def hf_layout(x: np.ndarray, n_in: int) -> np.ndarray:
    """jaxllm's weight [*in, *out] as torch's [out, in]."""
    return x.reshape(int(np.prod(x.shape[:n_in])), -1).T


def weight_args(bits: int, group: int, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy

    return QuantizationArgs(
        num_bits=bits,
        symmetric=symmetric,
        strategy=QuantizationStrategy.GROUP if group else QuantizationStrategy.CHANNEL,
        group_size=group or None,
    )


def check_norms(ours: dict, block) -> None:
    for path, name in NORMS.items():
        want = block.get_submodule(name).weight.detach().numpy()
        np.testing.assert_allclose(ours[path]["scale"], want, rtol=1e-5, err_msg=path)


def check_codes(got: np.ndarray, want: np.ndarray, what: str) -> None:
    same, worst = np.mean(got == want), np.abs(got - want).max()
    assert same >= 0.999 and worst <= 1, (what, same, worst)


def awq_recipe(group: int, duo: bool):
    """AWQ on jaxllm's candidates, then RTN int4 with a zero point of every linear but the
    head."""
    from compressed_tensors.quantization import QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    class JaxllmGrid(AWQModifier):
        def _get_grid_search_params(self):
            return [(0.0, False)] + [(i / GRID, self.duo_scaling) for i in range(GRID)]

    scheme = QuantizationScheme(targets=["Linear"], weights=weight_args(4, group, False))
    return [
        JaxllmGrid(duo_scaling=duo),
        QuantizationModifier(config_groups={"int4": scheme}, ignore=["lm_head"]),
    ]


@pytest.mark.parametrize("case", sorted(AWQ_CASES))
def test_awq_matches_llm_compressor(case, llama, monkeypatch):
    from compressed_tensors.quantization.lifecycle.forward import quantize

    kv_heads, group, duo = AWQ_CASES[case]
    src = llama(kv_heads)
    ours = jaxllm_block(
        src,
        [
            "quantize.method=awq",
            "quantize.bits=4",
            f"quantize.group_size={group}",
            "quantize.symmetric=false",
            "quantize.awq.clip=false",
            f"quantize.awq.duo_scaling={str(duo).lower()}",
            f"quantize.awq.grid={GRID}",
        ],
        monkeypatch,
    )
    block = llm_compressor(src, awq_recipe(group, duo), monkeypatch)
    check_norms(ours, block)
    for path, name in LINEARS.items():
        module, t = block.get_submodule(name), ours[path.split("/")[0]][path.split("/")[1]]
        scale = np.asarray(t.scales).reshape(len(t.scales), -1).T  # [out, groups]
        zero = np.asarray(t.zeros).reshape(len(t.zeros), -1).T.astype(np.float32) - 8
        deq = hf_layout(np.asarray(quantized.dequantize(t, jnp.float32)), t.n_in)
        g = deq.shape[1] // scale.shape[1]
        codes = np.round(deq / np.repeat(scale, g, 1)) + np.repeat(zero, g, 1)  # signed, as c-t

        ct_scale = module.weight_scale.detach().numpy()
        ct_zero = module.weight_zero_point.detach().numpy().astype(np.float32)
        want = quantize(
            module.weight,
            module.weight_scale,
            module.weight_zero_point,
            weight_args(4, group, False),
        )
        ulps = np.abs(scale.view(np.int32) - ct_scale.view(np.int32)).max()
        assert ulps <= 32, (path, ulps)
        np.testing.assert_array_equal(zero, ct_zero, err_msg=path)
        check_codes(codes, want.detach().numpy(), path)


@pytest.mark.parametrize("group", [0, 32])
def test_awq_duo_scaling_means_match_llm_compressor(group):
    """The mean relative |w| per input channel of a set: q [96 -> 96] and k [96 -> 32] (unequal
    readers) and two experts of a stack [2, 96, 40], each |w| relative to its group's largest."""
    import torch
    from compressed_tensors.quantization import QuantizationScheme
    from llmcompressor.modifiers.transform.awq import AWQModifier

    rng = np.random.default_rng(2)
    ws = [(rng.standard_t(3, (D, n)) * rng.uniform(0.2, 3, (D, 1))) for n in (96, 32)]
    ws = [w.astype(np.float32) * 0.05 for w in ws]
    experts = (rng.standard_t(3, (2, D, 40)) * 0.05).astype(np.float32)
    layers = []
    for w in [*ws, *experts]:
        lin = torch.nn.Linear(D, w.shape[1], bias=False)
        lin.weight = torch.nn.Parameter(torch.tensor(w.T.copy()))
        lin.quantization_scheme = QuantizationScheme(
            targets=["Linear"], weights=weight_args(4, group, True)
        )
        layers.append(lin)
    want = AWQModifier._compute_layer_means(layers).detach().numpy()
    got = awq._weight_magnitude((*map(jnp.asarray, ws), jnp.asarray(experts)), True, group)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def paper_statistic():
    """llm-compressor's SmoothQuant given the paper's statistic: each channel's recorded range
    made [-max|x|, max|x|], so its (max - min) / 2 is max|x|."""
    import torch
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    class PaperStatistic(SmoothQuantModifier):
        def _apply_smoothing(self, model):
            for s in self.scales_.values():
                m = torch.maximum(s.max_channel_vals.abs(), s.min_channel_vals.abs())
                s.min_channel_vals, s.max_channel_vals = -m, m
            super()._apply_smoothing(model)

    return PaperStatistic(smoothing_strength=0.5)


def test_smoothquant_matches_llm_compressor(llama, monkeypatch):
    src = llama(3)
    ours = jaxllm_block(src, ["quantize.method=smoothquant"], monkeypatch)
    block = llm_compressor(src, [paper_statistic()], monkeypatch)
    check_norms(ours, block)
    for path, name in LINEARS.items():
        w = block.get_submodule(name).weight.detach().numpy()  # smoothed, [out, in]
        t = ours[path.split("/")[0]][path.split("/")[1]]
        scale = np.asarray(t.scales).reshape(-1)
        np.testing.assert_allclose(scale, np.abs(w).max(1) / 127, rtol=1e-5, err_msg=path)
        codes = hf_layout(np.asarray(t.codes), t.n_in).astype(np.float32)
        check_codes(codes, np.round(w / scale[:, None]), path)


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_smoothquant_scales_match_llm_compressor(alpha):
    """s of q/k/v-like readers [96 -> 96, 32, 32] with uneven rows from activation maxima; the
    range llm-compressor measures is 2 max|x| (module docstring)."""
    import torch
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
    from llmcompressor.modifiers.transform.smoothquant.base import MINIMUM_SMOOTHING_SCALE

    rng = np.random.default_rng(3)
    ws = [rng.normal(0, 0.05, (D, n)) * rng.uniform(0.2, 3, (D, 1)) for n in (96, 32, 32)]
    ws = [w.astype(np.float32) for w in ws]
    act = rng.uniform(0.01, 20, D).astype(np.float32)
    layers = []
    for w in ws:
        lin = torch.nn.Linear(D, w.shape[1], bias=False)
        lin.weight = torch.nn.Parameter(torch.tensor(w.T.copy()))
        layers.append(lin)
    modifier = SmoothQuantModifier(smoothing_strength=alpha)
    want = modifier._calculate_smoothing_scales(layers, torch.tensor(2 * act))
    want = torch.maximum(want, torch.tensor([MINIMUM_SMOOTHING_SCALE])).detach().numpy()
    got = np.asarray(smoothquant.scales(jnp.asarray(act), [jnp.asarray(w) for w in ws], alpha))
    np.testing.assert_allclose(got * 2 ** (2 * alpha - 1), want, rtol=1e-5)
