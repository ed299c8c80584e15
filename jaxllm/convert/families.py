"""Hugging Face model families: `config.json` <-> `ModelConfig`, and tensor names <-> parameters.

A `Family` knows one `model_type`: how its config.json maps to `ModelConfig` fields (`to_model`,
refusing with ConfigError what the knobs cannot express), the config.json of a model
(`to_hf`), and the `Link`s between its safetensors names and our parameter paths. Every
transform is a reshape, a transpose or a split/concatenation, so importing and exporting give
back the same bytes.

Our layout vs torch's: a projection is [in..., out...] (`q_proj` [D, H, K]) where a torch
`nn.Linear` weight is [out, in] (`q_proj.weight` [H*K, D]); GPT-2's `Conv1D` stores [in, out]
and fuses q, k, v into one `c_attn`. Stacked layers carry a leading [N] axis here and one tensor
per layer there (`{i}` in a name); MoE expert weights [N, E, ...] are one tensor per layer and
expert in Mixtral and DeepSeek-V2/V3 checkpoints (`{i}`, `{j}`), one [E, ...] tensor per layer in
transformers 5's fused layout. DeepSeek-V2/V3 blocks are two stacks here (dense, then MoE), so
the MoE stack's layer k is HF layer first_k_dense_replace + k (`Link.offset`), and V3's routing
bias is model state (`RouterBias`), not a parameter.
"""

from __future__ import annotations

import dataclasses
import math
import string
from collections.abc import Callable

import numpy as np

from jaxllm import config as config_lib
from jaxllm.config import ConfigError, ModelConfig, MoEConfig

# ModelConfig fields that are training or compute choices, not part of a checkpoint.
NOT_ARCHITECTURE = frozenset(
    {"dtype", "param_dtype", "scan_unroll", "remat", "attention_impl", "init_std", "dropout"}
)
# MoEConfig fields of the same kind: how experts are dispatched and the balancing losses.
MOE_NOT_ARCHITECTURE = frozenset(
    {"dispatch", "capacity_factor", "aux_loss_weight", "router_z_loss_weight", "bias_update_rate"}
)
# ModelConfig fields of the dense MLP, which a model whose every block is MoE does not use.
DENSE_MLP = frozenset({"mlp_dim", "mlp_activation", "gelu_approximate", "mlp_bias"})


def _fail(msg: str):
    raise ConfigError(msg)


# -- tensor links -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Link:
    """One Hugging Face tensor (one per layer when `hf` holds `{i}`, per layer and expert when
    it also holds `{j}`) and the parameters it carries.

    Each placeholder of `hf` stands for one leading axis of `ours`, in order: our stacked
    [N, E, ...] expert weights are N * E tensors `...layers.{i}...experts.{j}...` there. The
    rest, one *element*, is transformed by kind: `same` (identical layout), `flat` (a 1-D
    tensor viewed as our [H, K]), `linear` (torch [out, in] -> ours [in..., out...], the first
    `n_in` axes of ours being inputs), `conv` (GPT-2 Conv1D [in, out] -> ours [in..., out...]).
    The first `n_lead` axes of an element stay in front on both sides (transformers 5's fused
    experts [E, out, in] are per-expert torch layouts). Several `ours` are concatenated along
    HF axis `axis` (GPT-2's fused q/k/v, Mixtral's fused gate/up). `offset` is the HF layer
    number of our first stacked layer (DeepSeek-V3's MoE blocks, stacked apart, follow its
    dense ones).
    """

    hf: str
    ours: tuple[str, ...]
    kind: str = "same"
    n_in: int = 1
    axis: int = -1
    n_lead: int = 0
    offset: int = 0

    @property
    def indices(self) -> tuple[str, ...]:
        """The placeholders of `hf` (`i`: layer, `j`: expert), one per split leading axis."""
        return tuple(f for _, f, _, _ in string.Formatter().parse(self.hf) if f)

    def counts(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """How many tensors per placeholder, given the full shapes of our parameters."""
        return tuple(shapes[self.ours[0]][: len(self.indices)])

    def name(self, index: tuple[int, ...] = ()) -> str:
        numbers = [k + (self.offset if f == "i" else 0) for f, k in zip(self.indices, index)]
        return self.hf.format(**dict(zip(self.indices, numbers)))

    def _part_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        lead, rest = tuple(shape[: self.n_lead]), shape[self.n_lead :]
        if self.kind == "same":
            return tuple(shape)
        if self.kind == "flat":
            return (*lead, math.prod(rest))
        ins, outs = math.prod(rest[: self.n_in]), math.prod(rest[self.n_in :])
        return (*lead, *((outs, ins) if self.kind == "linear" else (ins, outs)))

    def hf_shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        """The HF tensor's shape, given the element shapes of `ours`."""
        parts = [self._part_shape(s) for s in shapes]
        if len(parts) == 1:
            return parts[0]
        out = list(parts[0])
        out[self.axis] = sum(p[self.axis] for p in parts)
        return tuple(out)

    def to_ours(self, w: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
        parts = [w]
        if len(shapes) > 1:
            sizes = np.cumsum([self._part_shape(s)[self.axis] for s in shapes])[:-1]
            parts = np.split(w, sizes, axis=self.axis)
        return [self._one_to_ours(p, s) for p, s in zip(parts, shapes)]

    def _one_to_ours(self, w: np.ndarray, shape) -> np.ndarray:
        if self.kind == "linear":
            w = np.swapaxes(w, -1, -2)
        return np.ascontiguousarray(w.reshape(shape))

    def _one_to_hf(self, x: np.ndarray) -> np.ndarray:
        if self.kind != "linear":
            return x.reshape(self._part_shape(x.shape))
        lead, rest = x.shape[: self.n_lead], x.shape[self.n_lead :]
        return np.swapaxes(x.reshape(*lead, math.prod(rest[: self.n_in]), -1), -1, -2)

    def to_hf(self, xs: list[np.ndarray]) -> np.ndarray:
        parts = [self._one_to_hf(x) for x in xs]
        out = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=self.axis)
        return np.ascontiguousarray(out)


# -- config helpers -----------------------------------------------------------------------------


def _activation(name: str, gated: bool) -> dict:
    if name == "silu" and gated:
        return {"mlp_activation": "swiglu"}
    gelu = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True}
    if name in gelu:
        return {"mlp_activation": "geglu" if gated else "gelu", "gelu_approximate": gelu[name]}
    if name == "relu" and not gated:
        return {"mlp_activation": "relu"}
    _fail(f"activation {name!r} has no jaxllm model.mlp_activation equivalent here.")


def _activation_name(cfg: ModelConfig) -> str:
    if cfg.mlp_activation == "swiglu":
        return "silu"
    if cfg.mlp_activation in ("gelu", "geglu"):
        return "gelu_pytorch_tanh" if cfg.gelu_approximate else "gelu"
    return "silu"  # relu / relu2 in a gated family: the round-trip check names the mismatch


def _rope(hf: dict) -> dict:
    """RoPE fields from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    p = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if any(isinstance(v, dict) for v in p.values()):
        _fail("per-layer-type RoPE parameters (Gemma 3 style) are not supported.")
    theta = p.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = p.get("rope_type", p.get("type", "default"))
    if p.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        _fail("partial_rotary_factor != 1 (RoPE on part of the head) is not supported.")
    out: dict = {"rope_theta": float(theta)}
    original = p.get("original_max_position_embeddings")
    if kind == "default":
        return out
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_factor": float(p["factor"])}
    if kind == "llama3":
        return {**out, "rope_scaling": "llama3", "rope_factor": float(p["factor"]),
                "rope_low_freq_factor": float(p.get("low_freq_factor", 1.0)),
                "rope_high_freq_factor": float(p.get("high_freq_factor", 4.0)),
                "rope_original_max_len": original}  # fmt: skip
    if kind == "yarn":
        if p.get("truncate", True) is False:
            _fail("YaRN with truncate=false is not supported.")
        factor = p.get("factor") or hf["max_position_embeddings"] / original
        attention = p.get("attention_factor")
        if attention is None and p.get("mscale") and p.get("mscale_all_dim"):
            # transformers' rule (DeepSeek-V2/V3 configs): the two temperatures' ratio
            mscale, all_dim = p["mscale"], p["mscale_all_dim"]
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
        return {**out, "rope_scaling": "yarn", "rope_factor": float(factor),
                "rope_beta_fast": float(p.get("beta_fast") or 32.0),
                "rope_beta_slow": float(p.get("beta_slow") or 1.0),
                "rope_attention_factor": None if attention is None else float(attention),
                "rope_original_max_len": original}  # fmt: skip
    _fail(f"RoPE type {kind!r} is not supported (none, linear, llama3 and yarn are).")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1), as
    transformers' `get_mscale` and DeepSeek's `yarn_get_mscale` compute it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_to_hf(cfg: ModelConfig) -> dict:
    p: dict = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling,
               "rope_theta": cfg.rope_theta}  # fmt: skip
    original = cfg.rope_original_max_len or cfg.max_seq_len
    if cfg.rope_scaling == "ntk":
        _fail("model.rope_scaling=ntk has no Hugging Face rope_type (its `dynamic` differs).")
    if cfg.rope_scaling == "linear":
        p["factor"] = cfg.rope_factor
    elif cfg.rope_scaling == "llama3":
        p.update(factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                 high_freq_factor=cfg.rope_high_freq_factor,
                 original_max_position_embeddings=original)  # fmt: skip
    elif cfg.rope_scaling == "yarn":
        p.update(factor=cfg.rope_factor, beta_fast=cfg.rope_beta_fast,
                 beta_slow=cfg.rope_beta_slow, original_max_position_embeddings=original)  # fmt: skip
        if cfg.rope_attention_factor is not None:
            p["attention_factor"] = cfg.rope_attention_factor
    legacy = (
        None if cfg.rope_scaling == "none" else {k: v for k, v in p.items() if k != "rope_theta"}
    )
    return {"rope_parameters": p, "rope_theta": cfg.rope_theta, "rope_scaling": legacy}


def _windows(hf: dict, all_sliding_default: bool) -> dict:
    """sliding_window / global_every from `layer_types` (transformers 5) or the family's rule."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    n = hf["num_hidden_layers"]
    if types is None:
        if window is None or not all_sliding_default:
            return {}
        types = ["sliding_attention"] * n
    sliding = [t == "sliding_attention" for t in types]
    if set(types) - {"sliding_attention", "full_attention"}:
        _fail(f"layer_types {sorted(set(types))} are not supported.")
    if not any(sliding):
        return {}
    if window is None:
        _fail("layer_types has sliding_attention layers but sliding_window is null.")
    every = 0 if all(sliding) else sliding.index(False) + 1
    if sliding != [not (every and (i + 1) % every == 0) for i in range(n)]:
        _fail(f"layer_types {types} is not a periodic pattern of sliding and global layers.")
    return {"sliding_window": int(window), "global_every": every}


def _layer_types(cfg: ModelConfig) -> list[str]:
    windows = cfg.layer_windows() or (0,) * cfg.num_layers
    return ["sliding_attention" if w else "full_attention" for w in windows]


def _dtype_name(cfg: ModelConfig) -> str:
    return cfg.param_dtype


# -- families -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    to_model: Callable[[dict], dict]
    to_hf: Callable[[ModelConfig], dict]
    links: Callable[[ModelConfig], list[Link]]
    """The tensor layout export writes (and import reads first)."""
    ignore: tuple[str, ...] = ()
    """Suffixes of tensors that are not parameters (non-persistent buffers in old files)."""
    other_links: tuple[Callable[[ModelConfig], list[Link]], ...] = ()
    """Other tensor layouts import accepts (Mixtral: transformers 5's fused experts)."""
    skip: Callable[[ModelConfig, str], bool] | None = None
    """Tensors import leaves unread, by name (DeepSeek-V3's multi-token-prediction layers)."""

    def layouts(self, cfg: ModelConfig) -> list[list[Link]]:
        return [self.links(cfg), *(f(cfg) for f in self.other_links)]

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        """Whether import may leave the tensor `name` unmapped."""
        skipped = self.skip is not None and self.skip(cfg, name)
        return skipped or any(name.endswith(s) for s in self.ignore)


def _llama_like_model(hf: dict, *, tie_default: bool) -> dict:
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // h
    return {
        "vocab_size": hf["vocab_size"], "d_model": d, "num_layers": hf["num_hidden_layers"],
        "num_heads": h, "num_kv_heads": hf.get("num_key_value_heads") or h,
        "head_dim": None if head_dim * h == d else head_dim,
        "mlp_dim": hf["intermediate_size"], "max_seq_len": hf["max_position_embeddings"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", tie_default)),
        **_rope(hf),
    }  # fmt: skip


def _llama_like_hf(cfg: ModelConfig) -> dict:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.resolved_head_dim,
        "intermediate_size": cfg.mlp_dim, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": _activation_name(cfg), "dtype": _dtype_name(cfg), **_rope_to_hf(cfg),
    }  # fmt: skip


def _llama_like_links(cfg: ModelConfig, *, sandwich: bool = False, block: str = "layers/",
                      dense_mlp: bool = True) -> list[Link]:  # fmt: skip
    """Embedding, attention, norms and head of a Llama-style checkpoint; the blocks' stacked
    parameters live under `block` (`moe_layers/moe/` when every block is MoE), and their
    dense MLP is linked when `dense_mlp`."""
    p = "model.layers.{i}."
    attn, mlp = block + "attn/", block + "mlp/"
    links = [
        Link("model.embed_tokens.weight", ("embed/embedding",)),
        Link(p + "input_layernorm.weight", (block + "attn_norm/scale",)),
        Link(p + "self_attn.q_proj.weight", (attn + "q_proj",), "linear"),
        Link(p + "self_attn.k_proj.weight", (attn + "k_proj",), "linear"),
        Link(p + "self_attn.v_proj.weight", (attn + "v_proj",), "linear"),
        Link(p + "self_attn.o_proj.weight", (attn + "o_proj",), "linear", n_in=2),
        Link("model.norm.weight", ("final_norm/scale",)),
    ]
    if dense_mlp:
        links += [Link(p + f"mlp.{x}_proj.weight", (mlp + f"{x}_proj",), "linear")
                  for x in ("gate", "up", "down")]  # fmt: skip
    if sandwich:
        links += [
            Link(p + "post_attention_layernorm.weight", (block + "post_attn_norm/scale",)),
            Link(p + "pre_feedforward_layernorm.weight", (block + "mlp_norm/scale",)),
            Link(p + "post_feedforward_layernorm.weight", (block + "post_mlp_norm/scale",)),
        ]
    else:
        links.append(Link(p + "post_attention_layernorm.weight", (block + "mlp_norm/scale",)))
    if cfg.qkv_bias:
        links += [Link(p + f"self_attn.{x}_proj.bias", (attn + f"{x}_bias",), "flat")
                  for x in "qkv"]  # fmt: skip
    if cfg.o_bias:
        links.append(Link(p + "self_attn.o_proj.bias", (attn + "o_bias",)))
    if cfg.qk_norm:
        links += [Link(p + f"self_attn.{x}_norm.weight", (f"{attn}{x}_norm/scale",))
                  for x in "qk"]  # fmt: skip
    if cfg.mlp_bias and dense_mlp:
        links += [Link(p + f"mlp.{x}_proj.bias", (f"{mlp}{x}_bias",))
                  for x in ("gate", "up", "down")]  # fmt: skip
    if not cfg.tie_embeddings:
        links.append(Link("lm_head.weight", ("lm_head",), "linear"))
    return links


def _llama_model(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {**_llama_like_model(hf, tie_default=False), **_activation(hf.get("hidden_act", "silu"), True),
            "qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(hf.get("mlp_bias", False))}  # fmt: skip


def _llama_hf(cfg: ModelConfig) -> dict:
    return {**_llama_like_hf(cfg), "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}


def _mistral_model(hf: dict) -> dict:
    return {**_llama_like_model(hf, tie_default=False), **_activation(hf.get("hidden_act", "silu"), True),
            **_windows(hf, all_sliding_default=True)}  # fmt: skip


def _mistral_hf(cfg: ModelConfig) -> dict:
    return {**_llama_like_hf(cfg), "sliding_window": cfg.sliding_window}


def _mixtral_model(hf: dict) -> dict:
    """Mixtral (Jiang et al. 2024, arXiv:2401.04088): Mistral attention, every block a top-k
    of E SwiGLU experts with a softmax router renormalised over the chosen k, as
    `jaxllm.model.moe.route` with router_score=softmax and normalize_top_k."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        _fail(f"Mixtral with hidden_act={act!r}: jaxllm's experts are SwiGLU (silu) only.")
    if hf.get("router_jitter_noise") or 0.0:
        _fail(f"router_jitter_noise={hf['router_jitter_noise']} (multiplicative noise on the "
              "expert inputs in training) is not supported; set it to 0.")  # fmt: skip
    experts, top_k = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)
    if not 1 <= top_k <= experts:
        _fail(f"num_experts_per_tok={top_k} must be between 1 and num_local_experts={experts}.")
    moe = {
        "num_experts": experts, "experts_per_token": top_k,
        "expert_mlp_dim": hf["intermediate_size"], "num_shared_experts": 0,
        "first_dense_layers": 0, "moe_every": 1, "router_score": "softmax",
        "normalize_top_k": True, "route_scale": 1.0, "bias_update_rate": 0.0,
        "aux_loss_weight": float(hf.get("router_aux_loss_coef", 0.001)),
    }  # fmt: skip
    return {**_llama_like_model(hf, tie_default=False), "mlp_activation": "swiglu",
            **_windows(hf, all_sliding_default=True), "moe": moe}  # fmt: skip


def _mixtral_hf(cfg: ModelConfig) -> dict:
    """config.json of a Mixtral. `output_router_logits` stays false as in released Mixtral
    checkpoints (it turns on transformers' aux loss in training); the coefficient is ours."""
    if not cfg.moe.enabled:
        _fail("a dense model (model.moe.num_experts=0) has no Mixtral checkpoint; export it as "
              "llama or mistral.")  # fmt: skip
    return {
        **_llama_like_hf(cfg), "intermediate_size": cfg.resolved_expert_mlp_dim,
        "hidden_act": "silu", "sliding_window": cfg.sliding_window,
        "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.experts_per_token,
        "router_aux_loss_coef": cfg.moe.aux_loss_weight, "output_router_logits": False,
        "router_jitter_noise": 0.0,
    }  # fmt: skip


def _mixtral_links(cfg: ModelConfig) -> list[Link]:
    """Released Mixtral checkpoints (and transformers 5's `save_pretrained`): the router and
    every expert's w1 (gate), w3 (up), w2 (down) as separate torch Linear weights."""
    p, moe = "model.layers.{i}.block_sparse_moe.", "moe_layers/moe/mlp/"
    return [
        *_llama_like_links(cfg, block="moe_layers/moe/", dense_mlp=False),
        Link(p + "gate.weight", (moe + "router",), "linear"),
        Link(p + "experts.{j}.w1.weight", (moe + "gate_proj",), "linear"),
        Link(p + "experts.{j}.w3.weight", (moe + "up_proj",), "linear"),
        Link(p + "experts.{j}.w2.weight", (moe + "down_proj",), "linear"),
    ]


def _mixtral_fused_links(cfg: ModelConfig) -> list[Link]:
    """transformers 5's in-memory layout (`save_pretrained(save_original_format=False)`):
    per layer, `gate_up_proj` [E, 2F, D] (gate rows, then up rows) and `down_proj` [E, D, F]."""
    p, moe = "model.layers.{i}.mlp.", "moe_layers/moe/mlp/"
    gate_up = (moe + "gate_proj", moe + "up_proj")
    return [
        *_llama_like_links(cfg, block="moe_layers/moe/", dense_mlp=False),
        Link(p + "gate.weight", (moe + "router",), "linear"),
        Link(p + "experts.gate_up_proj", gate_up, "linear", axis=-2, n_lead=1),
        Link(p + "experts.down_proj", (moe + "down_proj",), "linear", n_lead=1),
    ]


def _deepseek_v3_model(hf: dict) -> dict:
    """DeepSeek-V3 (arXiv:2412.19437) as transformers runs it: Multi-head Latent Attention in
    every block (`model.mla`, RoPE on interleaved channel pairs unless rope_interleave=false),
    the first `first_k_dense_replace` blocks with a dense SwiGLU MLP and the rest MoE: sigmoid
    router scores plus the `e_score_correction_bias` for the choice (a frozen `RouterBias`),
    group-limited top-k (n_group / topk_group), renormalised weights times
    routed_scaling_factor, and shared experts. With YaRN, `mscale_all_dim` sharpens the
    softmax (attn_scale) and mscale / mscale_all_dim set the cos/sin factor."""
    return {**_deepseek_mla_model(hf, "DeepSeek-V3"),
            "rope_interleave": bool(hf.get("rope_interleave", True)), "moe": _deepseek_moe(hf)}  # fmt: skip


def _deepseek_mla_model(hf: dict, name: str) -> dict:
    """The fields DeepSeek-V2 and V3 config.json share (all but RoPE's pair order and the
    MoE): MLA shapes, YaRN and its softmax scale, SwiGLU MLPs without biases."""
    if hf.get("hidden_act", "silu") != "silu":
        _fail(f"{name} with hidden_act={hf['hidden_act']!r}: jaxllm's experts and shared "
              "experts are SwiGLU (silu) only.")  # fmt: skip
    if hf.get("attention_bias"):
        _fail(f"{name} with attention_bias=true (biases on q_a / kv_a / o projections) is "
              "not supported: jaxllm's MLA has no projection biases.")  # fmt: skip
    h = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or h) != h:
        _fail(f"{name} with num_key_value_heads={hf['num_key_value_heads']} != "
              f"num_attention_heads={h}: MLA expands the latent into every head.")  # fmt: skip
    mla = {
        "kv_lora_rank": hf["kv_lora_rank"], "q_lora_rank": hf.get("q_lora_rank") or 0,
        "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
    }  # fmt: skip
    rope = _rope(hf)
    return {
        "vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"], "num_heads": h, "num_kv_heads": h,
        "head_dim": None, "mlp_dim": hf["intermediate_size"],
        "max_seq_len": hf["max_position_embeddings"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "mlp_activation": "swiglu", "attn_scale": _deepseek_scale(hf, rope), "mla": mla, **rope,
    }  # fmt: skip


def _deepseek_scale(hf: dict, rope: dict) -> float | None:
    """transformers' `yarn_apply_mscale`: with a scaled RoPE (any rope_type but default) and
    `mscale_all_dim`, the softmax scale qk_head_dim^-0.5 is multiplied by
    mscale(factor, mscale_all_dim)^2; null (the default scale) otherwise."""
    p = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    all_dim = p.get("mscale_all_dim")
    if rope.get("rope_scaling", "none") == "none" or not all_dim:
        return None
    m = _yarn_mscale(rope["rope_factor"], all_dim)
    return None if m == 1 else (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5 * m * m


def _deepseek_moe(hf: dict) -> dict:
    """model.moe of a DeepSeek-V3 config.json; {} (dense) when every block is dense. Only what
    transformers (and DeepSeek's own code for V3) runs is accepted: sigmoid scores, the
    `noaux_tc` choice, every block after the dense ones MoE."""
    first, n = hf.get("first_k_dense_replace", 3), hf["num_hidden_layers"]
    if first is None:
        _fail("DeepSeek-V3 first_k_dense_replace=null: give the number of leading dense blocks.")
    if first >= n:
        return {}
    only = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
    for key, want in only.items():
        if hf.get(key, want) != want:
            _fail(f"DeepSeek-V3 with {key}={hf[key]!r} is not supported: transformers' DeepSeek-V3 "
                  f"(and jaxllm's import) runs {key}={want!r} only.")  # fmt: skip
    experts, top_k = hf.get("n_routed_experts", 256), hf.get("num_experts_per_tok", 8)
    groups, keep = hf.get("n_group", 8), hf.get("topk_group", 4)
    if groups is None or keep is None:
        _fail("DeepSeek-V3 MoE blocks need n_group and topk_group (1 and 1: no groups).")
    shared = hf.get("n_shared_experts", 1)
    if not shared:
        _fail("DeepSeek-V3 with n_shared_experts=0 is not supported (transformers builds "
              "zero-width shared experts); jaxllm needs at least one shared expert here.")  # fmt: skip
    return {
        "num_experts": experts, "experts_per_token": top_k,
        "expert_mlp_dim": hf.get("moe_intermediate_size", 2048), "num_shared_experts": shared,
        "first_dense_layers": first, "moe_every": 1, "router_score": "sigmoid",
        "normalize_top_k": bool(hf.get("norm_topk_prob", True)),
        "route_scale": float(hf.get("routed_scaling_factor", 2.5)),
        "num_groups": groups, "groups_per_token": keep, "router_bias": True,
        # training choices: the imported bias stays frozen, and DeepSeek-V3 balances by that
        # bias rather than by jaxllm's batch-level aux loss or a z-loss
        "bias_update_rate": 0.0, "aux_loss_weight": 0.0, "router_z_loss_weight": 0.0,
    }  # fmt: skip


def _deepseek_v2_model(hf: dict) -> dict:
    """DeepSeek-V2 / V2-Lite (arXiv:2405.04434) as transformers' `DeepseekV2ForCausalLM` runs
    it: DeepSeek-V3's MLA blocks (always RoPE on interleaved channel pairs, as complex
    numbers; no rope_interleave key), the first `first_k_dense_replace` blocks dense and the
    rest MoE with softmax router scores, plain top-k (`greedy`) or top-k within the best
    topk_group of n_group groups ranked by their highest score (`group_limited_greedy`), the
    chosen scores times routed_scaling_factor without renormalising, and shared experts."""
    if hf.get("mlp_bias"):
        _fail("DeepSeek-V2 with mlp_bias=true is not supported: jaxllm's SwiGLU MLPs and "
              "experts have no biases.")  # fmt: skip
    return {**_deepseek_mla_model(hf, "DeepSeek-V2"), "rope_interleave": True,
            "moe": _deepseek_v2_moe(hf)}  # fmt: skip


def _deepseek_v2_moe(hf: dict) -> dict:
    """model.moe of a DeepSeek-V2 config.json; {} (dense) when every block is dense. Refused:
    what transformers' DeepSeek-V2 ignores where DeepSeek's own code would act on it
    (moe_layer_freq != 1, norm_topk_prob=true), so the two runs would disagree."""
    first, n = hf.get("first_k_dense_replace", 0), hf["num_hidden_layers"]
    if first is None or first >= n:
        return {}
    for key, want in {"scoring_func": "softmax", "moe_layer_freq": 1}.items():
        if hf.get(key, want) != want:
            _fail(f"DeepSeek-V2 with {key}={hf[key]!r} is not supported: transformers' "
                  f"DeepSeek-V2 (and jaxllm's import) runs {key}={want!r} only.")  # fmt: skip
    if hf.get("norm_topk_prob"):
        _fail("DeepSeek-V2 with norm_topk_prob=true is not supported: transformers' DeepSeek-V2 "
              "never renormalises the top-k weights while DeepSeek's own code does.")  # fmt: skip
    method = hf.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        _fail(f"DeepSeek-V2 with topk_method={method!r} is not supported (greedy and "
              "group_limited_greedy are).")  # fmt: skip
    groups = {"num_groups": 1, "groups_per_token": 1}
    if method == "group_limited_greedy":
        if hf.get("n_group") is None or hf.get("topk_group") is None:
            _fail("DeepSeek-V2 topk_method='group_limited_greedy' needs n_group and topk_group.")
        groups = {"num_groups": hf["n_group"], "groups_per_token": hf["topk_group"],
                  "group_score": "max"}  # fmt: skip
    if hf.get("num_experts_per_tok") is None:
        _fail("DeepSeek-V2 MoE blocks need num_experts_per_tok (the top-k).")
    shared = hf.get("n_shared_experts", 2)
    if not shared:
        _fail("DeepSeek-V2 with n_shared_experts=0 is not supported (transformers builds "
              "zero-width shared experts); jaxllm needs at least one shared expert here.")  # fmt: skip
    return {
        "num_experts": hf.get("n_routed_experts", 64), "experts_per_token": hf["num_experts_per_tok"],
        "expert_mlp_dim": hf.get("moe_intermediate_size", 1407), "num_shared_experts": shared,
        "first_dense_layers": first, "moe_every": 1, "router_score": "softmax",
        "normalize_top_k": False, "route_scale": float(hf.get("routed_scaling_factor", 1.0)),
        **groups,
    }  # fmt: skip


def _deepseek_v2_hf(cfg: ModelConfig) -> dict:
    """config.json of a DeepSeek-V2: `greedy` routing without groups, else
    `group_limited_greedy` (exact also when topk_group = n_group, which limits nothing)."""
    out = _deepseek_mla_hf(cfg, "deepseek_v2")
    moe = cfg.moe
    if moe.enabled:
        limited = moe.num_groups > 1
        out.update({
            **_deepseek_moe_hf(cfg), "scoring_func": "softmax",
            "topk_method": "group_limited_greedy" if limited else "greedy",
            "n_group": moe.num_groups if limited else None,
            "topk_group": moe.groups_per_token if limited else None,
        })  # fmt: skip
    return out


def _deepseek_v3_hf(cfg: ModelConfig) -> dict:
    """config.json of a DeepSeek-V3. No multi-token-prediction module is written
    (num_nextn_predict_layers=0): jaxllm models have none."""
    out = {**_deepseek_mla_hf(cfg, "deepseek_v3"), "rope_interleave": cfg.rope_interleave,
           "num_nextn_predict_layers": 0}  # fmt: skip
    moe = cfg.moe
    if moe.enabled:
        out.update({
            **_deepseek_moe_hf(cfg), "n_group": moe.num_groups, "topk_group": moe.groups_per_token,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        })  # fmt: skip
    return out


def _deepseek_mla_hf(cfg: ModelConfig, family: str) -> dict:
    """The config.json keys DeepSeek-V2 and V3 share (the inverse of `_deepseek_mla_model`);
    every block dense (first_k_dense_replace = layers) until `_deepseek_moe_hf` says else."""
    if not cfg.mla.enabled:
        _fail(f"a model without MLA (model.mla.kv_lora_rank=0) has no {family} checkpoint; "
              "export it as another family.")  # fmt: skip
    a, h = cfg.mla, cfg.num_heads
    out = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": h, "num_key_value_heads": h,
        "intermediate_size": cfg.mlp_dim, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "dtype": _dtype_name(cfg),
        "kv_lora_rank": a.kv_lora_rank, "q_lora_rank": a.q_lora_rank or None,
        "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim, "first_k_dense_replace": cfg.num_layers, **_rope_to_hf(cfg),
    }  # fmt: skip
    all_dim = _mscale_all_dim(cfg)
    if all_dim is not None:
        for key in ("rope_parameters", "rope_scaling"):
            out[key] = {**out[key], "mscale_all_dim": all_dim}
    return out


def _deepseek_moe_hf(cfg: ModelConfig) -> dict:
    """The MoE keys DeepSeek-V2 and V3 share: sizes, dense blocks, the weights' scaling."""
    moe = cfg.moe
    return {
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
        "moe_intermediate_size": cfg.resolved_expert_mlp_dim,
        "n_shared_experts": moe.num_shared_experts,
        "first_k_dense_replace": moe.first_dense_layers, "moe_layer_freq": 1,
        "routed_scaling_factor": moe.route_scale, "norm_topk_prob": moe.normalize_top_k,
    }  # fmt: skip


def _mscale_all_dim(cfg: ModelConfig) -> float | None:
    """The `mscale_all_dim` that makes transformers' softmax scale model.attn_scale (the
    inverse of `_deepseek_scale`); None for the default scale, or when no YaRN factor can
    carry it (the read-back check then names model.attn_scale)."""
    default = cfg.mla.qk_head_dim**-0.5
    if cfg.attn_scale is None or math.isclose(cfg.attn_scale, default):
        return None
    if cfg.rope_scaling != "yarn" or cfg.rope_factor <= 1:
        return None
    m = math.sqrt(cfg.attn_scale / default)
    return float(f"{(m - 1) / (0.1 * math.log(cfg.rope_factor)):.12g}")


def _deepseek_links(cfg: ModelConfig, fused: bool = False) -> list[Link]:
    """DeepSeek-V2 and V3 checkpoints (the same names; V2 has no routing bias): blocks numbered 0..N-1 across our two stacks (`layers` for the
    first_k_dense_replace dense blocks, `moe_layers/moe` for the rest). `fused`: transformers
    5's in-memory experts (`save_pretrained(save_original_format=False)`), else one tensor per
    expert as released checkpoints and the default `save_pretrained` hold them."""
    first = cfg.moe.first_dense_layers if cfg.moe.enabled else cfg.num_layers
    links = [
        Link("model.embed_tokens.weight", ("embed/embedding",)),
        Link("model.norm.weight", ("final_norm/scale",)),
    ]
    if not cfg.tie_embeddings:
        links.append(Link("lm_head.weight", ("lm_head",), "linear"))
    if first:
        links += _deepseek_block_links(cfg, "layers/", 0)
    if cfg.moe.enabled:
        links += _deepseek_block_links(cfg, "moe_layers/moe/", first, moe=True, fused=fused)
    return links


def _deepseek_block_links(cfg: ModelConfig, block: str, offset: int, moe: bool = False,
                          fused: bool = False) -> list[Link]:  # fmt: skip
    """One stack of DeepSeek-V2/V3 blocks (HF layers offset, offset + 1, ...): MLA, norms, and
    the dense MLP or the MoE layer."""
    attn, mlp = block + "attn/", block + "mlp/"

    def link(hf: str, ours: str | tuple[str, ...], kind: str = "same", **kw) -> Link:
        ours = (ours,) if isinstance(ours, str) else ours
        return Link("model.layers.{i}." + hf, ours, kind, offset=offset, **kw)

    links = [
        link("input_layernorm.weight", block + "attn_norm/scale"),
        link("post_attention_layernorm.weight", block + "mlp_norm/scale"),
        link("self_attn.kv_a_proj_with_mqa.weight", attn + "kv_a_proj", "linear"),
        link("self_attn.kv_a_layernorm.weight", attn + "kv_a_norm/scale"),
        link("self_attn.kv_b_proj.weight", attn + "kv_b_proj", "linear"),
        link("self_attn.o_proj.weight", attn + "o_proj", "linear", n_in=2),
    ]
    if cfg.mla.q_lora_rank:
        links += [
            link("self_attn.q_a_proj.weight", attn + "q_a_proj", "linear"),
            link("self_attn.q_a_layernorm.weight", attn + "q_a_norm/scale"),
            link("self_attn.q_b_proj.weight", attn + "q_b_proj", "linear"),
        ]
    else:
        links.append(link("self_attn.q_proj.weight", attn + "q_proj", "linear"))
    projections = ("gate", "up", "down")
    if not moe:
        return links + [link(f"mlp.{x}_proj.weight", f"{mlp}{x}_proj", "linear")
                        for x in projections]  # fmt: skip
    links.append(link("mlp.gate.weight", mlp + "router", "linear"))
    if cfg.moe.has_router_bias:
        links.append(link("mlp.gate.e_score_correction_bias", mlp + "router_bias"))
    if cfg.moe.num_shared_experts:
        links += [link(f"mlp.shared_experts.{x}_proj.weight", f"{mlp}shared/{x}_proj", "linear")
                  for x in projections]  # fmt: skip
    if fused:
        return links + [
            link("mlp.experts.gate_up_proj", (mlp + "gate_proj", mlp + "up_proj"), "linear",
                 axis=-2, n_lead=1),
            link("mlp.experts.down_proj", mlp + "down_proj", "linear", n_lead=1),
        ]  # fmt: skip
    return links + [link(f"mlp.experts.{{j}}.{x}_proj.weight", f"{mlp}{x}_proj", "linear")
                    for x in projections]  # fmt: skip


def _beyond_last_layer(cfg: ModelConfig, name: str) -> bool:
    """Tensors of blocks past num_hidden_layers: DeepSeek-V3's multi-token-prediction module
    (`model.layers.61.*` in the released checkpoint), which transformers does not load
    either."""
    parts = name.split(".")
    layer = parts[2] if name.startswith("model.layers.") else ""
    return layer.isdigit() and int(layer) >= cfg.num_layers


def _qwen_model(hf: dict, qwen3: bool) -> dict:
    if hf.get("use_sliding_window") and hf.get("layer_types") is None:
        _fail("Qwen use_sliding_window without layer_types is not supported.")
    out = {**_llama_like_model(hf, tie_default=False), **_activation(hf.get("hidden_act", "silu"), True),
           **_windows(hf, all_sliding_default=False)}  # fmt: skip
    if qwen3:
        bias = bool(hf.get("attention_bias", False))
        return {**out, "qk_norm": True, "qkv_bias": bias, "o_bias": bias}
    return {**out, "qkv_bias": True}


def _qwen_hf(cfg: ModelConfig, qwen3: bool) -> dict:
    out = {**_llama_like_hf(cfg), "sliding_window": cfg.sliding_window,
           "use_sliding_window": cfg.sliding_window is not None,
           "layer_types": _layer_types(cfg), "max_window_layers": cfg.num_layers}  # fmt: skip
    if qwen3:
        out["attention_bias"] = cfg.qkv_bias
    return out


def _gemma2_model(hf: dict) -> dict:
    windows = _windows(hf, all_sliding_default=False)
    if hf.get("layer_types") is None and hf.get("sliding_window") is not None:
        windows = {"sliding_window": int(hf["sliding_window"]), "global_every": 2}
    cap = hf.get("attn_logit_softcapping")
    final = hf.get("final_logit_softcapping")
    return {
        **_llama_like_model(hf, tie_default=True),
        **_activation(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
                      True),
        **windows,
        "norm_placement": "sandwich", "norm_offset": 1.0, "scale_embeddings": True,
        "attn_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_soft_cap": None if cap is None else float(cap),
        "final_soft_cap": None if final is None else float(final),
    }  # fmt: skip


def _gemma2_hf(cfg: ModelConfig) -> dict:
    out = _llama_like_hf(cfg)
    out.pop("hidden_act")
    scalar = (cfg.attn_scale or cfg.resolved_head_dim**-0.5) ** -2
    return {
        **out, "hidden_activation": _activation_name(cfg),
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        "attn_logit_softcapping": cfg.attn_soft_cap, "final_logit_softcapping": cfg.final_soft_cap,
        "sliding_window": cfg.sliding_window, "layer_types": _layer_types(cfg),
    }  # fmt: skip


def _gemma3_model(hf: dict) -> dict:
    """Gemma 3 text: Gemma 2's block with QK-norm, windows from `layer_types` (or the older
    `sliding_window_pattern`, default 6), and RoPE per layer type: global layers take
    rope_theta with the scaling, sliding ones rope_local_theta unscaled."""
    if hf.get("use_bidirectional_attention"):
        _fail("Gemma 3 use_bidirectional_attention=true (a non-causal encoder) is not supported.")
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("sliding_window_pattern") or 6
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(hf["num_hidden_layers"])]  # fmt: skip
    global_p, local_p = _gemma3_rope_parameters(hf)
    rope_hf = {**hf, "rope_parameters": global_p, "rope_scaling": None}
    out = {
        **_gemma2_model({**rope_hf, "layer_types": types,
                         "sliding_window": hf.get("sliding_window", 4096)}),
        "qk_norm": True, "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": bool(hf.get("attention_bias", False)),
    }  # fmt: skip
    local = _rope({**hf, "rope_parameters": local_p, "rope_scaling": None})
    if set(local) != {"rope_theta"}:
        _fail(f"Gemma 3 sliding-layer RoPE {local_p} is not supported: windowed layers take "
              "an unscaled base (model.rope_local_theta).")  # fmt: skip
    if out.get("sliding_window") is not None:
        out["rope_local_theta"] = local["rope_theta"]
    return out


def _gemma3_rope_parameters(hf: dict) -> tuple[dict, dict]:
    """(global, sliding) RoPE parameters: transformers 5 keys `rope_parameters` by layer type;
    older config.json files have rope_theta + rope_scaling and rope_local_base_freq."""
    p = hf.get("rope_parameters") or {}
    if "full_attention" in p or "sliding_attention" in p:
        global_p = {"rope_theta": 1e6, **(p.get("full_attention") or {})}
        local_p = {"rope_theta": 1e4, **(p.get("sliding_attention") or {})}
        return global_p, local_p
    global_p = {**(hf.get("rope_scaling") or {}), **p}
    global_p.setdefault("rope_theta", hf.get("rope_theta") or 1e6)
    return global_p, {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq") or 1e4}


def _gemma3_hf(cfg: ModelConfig) -> dict:
    rope = _rope_to_hf(cfg)
    local_theta = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
    return {
        **_gemma2_hf(cfg), "attention_bias": cfg.qkv_bias,
        "rope_parameters": {
            "full_attention": rope["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "rope_local_base_freq": local_theta,  # with rope_theta / rope_scaling: older readers
    }  # fmt: skip


def _gpt2_model(hf: dict) -> dict:
    if hf.get("scale_attn_by_inverse_layer_idx"):
        _fail("GPT-2 scale_attn_by_inverse_layer_idx=true (a per-layer scale) is not supported.")
    d = hf["n_embd"]
    return {
        "vocab_size": hf["vocab_size"], "d_model": d, "num_layers": hf["n_layer"],
        "num_heads": hf["n_head"], "num_kv_heads": hf["n_head"], "mlp_dim": hf.get("n_inner") or 4 * d,
        "max_seq_len": hf["n_positions"], "position": "learned", "norm": "layernorm",
        "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
        **_activation(hf.get("activation_function", "gelu_new"), gated=False),
        "qkv_bias": True, "o_bias": True, "mlp_bias": True,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "attn_scale": None if hf.get("scale_attn_weights", True) else 1.0,
    }  # fmt: skip


def _gpt2_hf(cfg: ModelConfig) -> dict:
    acts = {"gelu": "gelu_new" if cfg.gelu_approximate else "gelu", "relu": "relu"}
    act = acts.get(cfg.mlp_activation, "gelu_new")  # others: named by the round-trip check
    return {
        "vocab_size": cfg.vocab_size, "n_embd": cfg.d_model, "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads, "n_inner": cfg.mlp_dim, "n_positions": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps, "activation_function": act,
        "tie_word_embeddings": cfg.tie_embeddings, "scale_attn_weights": cfg.attn_scale != 1.0,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "dtype": _dtype_name(cfg),
    }  # fmt: skip


def _gpt2_links(cfg: ModelConfig) -> list[Link]:
    p, attn, mlp = "transformer.h.{i}.", "layers/attn/", "layers/mlp/"
    links = [
        Link("transformer.wte.weight", ("embed/embedding",)),
        Link("transformer.wpe.weight", ("pos_embed",)),
        Link(p + "ln_1.weight", ("layers/attn_norm/scale",)),
        Link(p + "ln_1.bias", ("layers/attn_norm/bias",)),
        Link(p + "attn.c_attn.weight", tuple(attn + f"{x}_proj" for x in "qkv"), "conv", axis=1),
        Link(p + "attn.c_attn.bias", tuple(attn + f"{x}_bias" for x in "qkv"), "flat", axis=0),
        Link(p + "attn.c_proj.weight", (attn + "o_proj",), "conv", n_in=2),
        Link(p + "attn.c_proj.bias", (attn + "o_bias",)),
        Link(p + "ln_2.weight", ("layers/mlp_norm/scale",)),
        Link(p + "ln_2.bias", ("layers/mlp_norm/bias",)),
        Link(p + "mlp.c_fc.weight", (mlp + "up_proj",), "conv"),
        Link(p + "mlp.c_fc.bias", (mlp + "up_bias",)),
        Link(p + "mlp.c_proj.weight", (mlp + "down_proj",), "conv"),
        Link(p + "mlp.c_proj.bias", (mlp + "down_bias",)),
        Link("transformer.ln_f.weight", ("final_norm/scale",)),
        Link("transformer.ln_f.bias", ("final_norm/bias",)),
    ]
    if not cfg.tie_embeddings:
        links.append(Link("lm_head.weight", ("lm_head",), "linear"))
    return links


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", _llama_model, _llama_hf, _llama_like_links),
        Family("mistral", "MistralForCausalLM", _mistral_model, _mistral_hf, _llama_like_links),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            lambda hf: _qwen_model(hf, False),
            lambda c: _qwen_hf(c, False),
            _llama_like_links,
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            lambda hf: _qwen_model(hf, True),
            lambda c: _qwen_hf(c, True),
            _llama_like_links,
        ),
        Family(
            "gemma2",
            "Gemma2ForCausalLM",
            _gemma2_model,
            _gemma2_hf,
            lambda c: _llama_like_links(c, sandwich=True),
        ),
        Family(
            "gemma3_text",
            "Gemma3ForCausalLM",
            _gemma3_model,
            _gemma3_hf,
            lambda c: _llama_like_links(c, sandwich=True),
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            _mixtral_model,
            _mixtral_hf,
            _mixtral_links,
            other_links=(_mixtral_fused_links,),
        ),
        Family(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            _deepseek_v3_model,
            _deepseek_v3_hf,
            _deepseek_links,
            other_links=(lambda c: _deepseek_links(c, fused=True),),
            skip=_beyond_last_layer,
        ),
        Family(
            "deepseek_v2",
            "DeepseekV2ForCausalLM",
            _deepseek_v2_model,
            _deepseek_v2_hf,
            _deepseek_links,
            other_links=(lambda c: _deepseek_links(c, fused=True),),
        ),
        Family(
            "gpt2",
            "GPT2LMHeadModel",
            _gpt2_model,
            _gpt2_hf,
            _gpt2_links,
            ignore=(".attn.bias", ".attn.masked_bias"),
        ),
    )  # fmt: skip
}


def family_of(hf: dict) -> Family:
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        _fail(f"model_type {kind!r} is not supported; supported: {', '.join(FAMILIES)}.")
    return FAMILIES[kind]


def model_fields(hf: dict) -> dict:
    """The ModelConfig fields of a config.json (architecture only)."""
    return family_of(hf).to_model(hf)


def guess_family(cfg: ModelConfig) -> Family:
    """The family a model exports as when none is named: the one its knobs point to."""
    if cfg.mla.enabled and cfg.moe.enabled and cfg.moe.router_score == "softmax":
        return FAMILIES["deepseek_v2"]
    if cfg.mla.enabled:
        return FAMILIES["deepseek_v3"]
    if cfg.moe.enabled:
        return FAMILIES["mixtral"]
    if cfg.position == "learned":
        return FAMILIES["gpt2"]
    if cfg.norm_placement == "sandwich":  # Gemma 2 has neither QK-norm nor a local RoPE base
        gemma3 = cfg.rope_local_theta is not None or cfg.qk_norm
        return FAMILIES["gemma3_text" if gemma3 else "gemma2"]
    if cfg.qk_norm:
        return FAMILIES["qwen3"]
    if cfg.qkv_bias and not cfg.o_bias:
        return FAMILIES["qwen2"]
    if cfg.sliding_window is not None:
        return FAMILIES["mistral"]
    return FAMILIES["llama"]


def hf_config(cfg: ModelConfig, family: Family) -> dict:
    """config.json of `cfg` as `family`; ConfigError naming the knobs the family cannot hold
    (found by reading the written config back and comparing)."""
    out = {"architectures": [family.architecture], "model_type": family.name, **family.to_hf(cfg)}
    try:
        back = config_lib.from_dict({"model": family.to_model(out)}).model
    except ConfigError as e:
        _fail(f"this model cannot be expressed in a {family.name} checkpoint: {e}")
    diff = _differences(cfg, back)
    if diff:
        _fail(f"{', '.join(diff)} cannot be expressed in a {family.name} checkpoint; export as "
              f"another family (--family) or change the model.")  # fmt: skip
    return out


def _differences(cfg: ModelConfig, back: ModelConfig) -> list[str]:
    """The architecture knobs of `cfg` that `back` (its config.json read back) lost."""
    skip = NOT_ARCHITECTURE | {"moe"}
    if not (_has_dense_blocks(cfg) or _has_dense_blocks(back)):
        skip |= DENSE_MLP
    diff = [
        f"model.{f.name}={getattr(cfg, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in skip and not _same(f.name, getattr(cfg, f.name), getattr(back, f.name), cfg)
    ]  # fmt: skip
    if not (cfg.moe.enabled or back.moe.enabled):
        return diff
    if cfg.moe.enabled != back.moe.enabled:  # the other MoE knobs mean nothing to a dense side
        return [*diff, f"model.moe.num_experts={cfg.moe.num_experts}"]
    diff += [
        f"model.moe.{f.name}={getattr(cfg.moe, f.name)!r}"
        for f in dataclasses.fields(MoEConfig)
        if f.name not in MOE_NOT_ARCHITECTURE | {"router_bias"}
        and not (f.name == "expert_mlp_dim"
                 and cfg.resolved_expert_mlp_dim == back.resolved_expert_mlp_dim)
        and not _same(f.name, getattr(cfg.moe, f.name), getattr(back.moe, f.name), cfg)
    ]  # fmt: skip
    if cfg.moe.has_router_bias != back.moe.has_router_bias:  # a bias the family lacks, or needs
        rate = cfg.moe.bias_update_rate
        diff.append(f"model.moe.bias_update_rate={rate!r}" if rate > 0
                    else f"model.moe.router_bias={cfg.moe.router_bias!r}")  # fmt: skip
    return diff


def _has_dense_blocks(cfg: ModelConfig) -> bool:
    moe = cfg.moe
    return not moe.enabled or moe.first_dense_layers > 0 or moe.moe_every > 1


def _same(name: str, a, b, cfg: ModelConfig) -> bool:
    if name == "head_dim":
        return cfg.resolved_head_dim == (b or cfg.d_model // cfg.num_heads)
    if name == "rope_local_theta" and cfg.rope_scaling == "none":  # null: rope_theta
        return math.isclose(a or cfg.rope_theta, b or cfg.rope_theta)
    if name == "rope_original_max_len":
        return (a or cfg.max_seq_len) == (b or cfg.max_seq_len)
    if name == "attn_scale":
        default = (cfg.mla.qk_head_dim if cfg.mla.enabled else cfg.resolved_head_dim) ** -0.5
        return math.isclose(a or default, b or default)
    if name.startswith("rope_") and cfg.position != "rope":
        return True
    if name == "group_score" and cfg.moe.groups_per_token == cfg.moe.num_groups:
        return True  # no group limit: how groups would be ranked does not matter
    if name == "gelu_approximate" and cfg.mlp_activation not in ("gelu", "geglu"):
        return True
    if name == "global_every" and cfg.sliding_window is None:
        return True
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b
