"""Qwen3-Next (Hugging Face `Qwen3NextForCausalLM`, `model_type` qwen3_next): a hybrid of Gated
DeltaNet blocks (`linear_attn`) and gated softmax-attention blocks (`self_attn`) in the order of
config.json's `layer_types`, every block's MLP a top-k MoE of small experts plus one shared
expert scaled by a sigmoid gate; norms store weight - 1 (`(1 + w) * x`, model.norm_offset=1),
q/k are RMS-normalised per head and RoPE turns a quarter of each head.

Its fused projections interleave per group (`GroupedLink`): `in_proj_qkvz` holds, for each
query/key head, [q ; k ; its value heads' v ; their z], `in_proj_ba` [b ; a] per query/key
head, and the attention `q_proj` [q ; gate] per head; `conv1d` is one depthwise filter over
[q ; k ; v] channels ([C, 1, W]). Ours keeps each part apart ([D, heads, width]), so heads
split over `tensor` as any projection's do.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.convert.config_map import _fail
from jaxllm.convert.links import Family, Link
from jaxllm.convert.llama import llama_like_hf, llama_like_model

TYPES = {"linear_attention": "linear", "full_attention": "full"}


@dataclasses.dataclass(frozen=True)
class GroupedLink(Link):
    """A `linear` link whose parts interleave in `groups` equal groups along the HF output
    axis (each group: its share of part 0, then of part 1, ...); `conv`: the HF tensor is a
    depthwise Conv1d weight [C, 1, W] (ours [W, heads, width])."""

    groups: int = 1
    conv: bool = False

    def hf_shape(self, shapes):
        out, ins = Link.hf_shape(dataclasses.replace(self, axis=0), shapes)
        return (out, 1, ins) if self.conv else (out, ins)

    def to_ours(self, w, shapes):
        w = w[:, 0, :] if self.conv else w
        sizes = np.cumsum([self._part_shape(s)[0] // self.groups for s in shapes])[:-1]
        parts = np.split(w.reshape(self.groups, -1, w.shape[-1]), sizes, axis=1)
        return [self._one_to_ours(p.reshape(-1, w.shape[-1]), s) for p, s in zip(parts, shapes)]

    def to_hf(self, xs):
        parts = [self._one_to_hf(x) for x in xs]
        ins = parts[0].shape[-1]
        out = np.concatenate([p.reshape(self.groups, -1, ins) for p in parts], axis=1)
        out = out.reshape(-1, ins)
        return np.ascontiguousarray(out[:, None, :] if self.conv else out)


def _pattern(types: list[str], n: int) -> tuple[str, ...]:
    """The shortest repeating unit of `layer_types` as model.layer_pattern entries."""
    bad = [t for t in types if t not in TYPES]
    if bad:
        _fail(
            f"config.json layer_types entry {bad[0]!r} is not supported (linear_attention or "
            "full_attention)."
        )
    if len(types) != n:
        _fail(f"config.json layer_types has {len(types)} entries for {n} num_hidden_layers.")
    kinds = [TYPES[t] for t in types]
    period = next(p for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))
    return tuple(kinds[:period])


def _qwen3_next_model(hf: dict) -> dict:
    n = hf["num_hidden_layers"]
    every = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)
    ]
    pattern = _pattern(list(types), n)
    if hf.get("hidden_act", "silu") != "silu":
        _fail(f"Qwen3-Next with hidden_act={hf['hidden_act']!r}: jaxllm's MLPs are SwiGLU.")
    if hf.get("attention_bias"):
        _fail("Qwen3-Next with attention_bias=true is not supported.")
    params = dict(hf.get("rope_parameters") or {})
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    plain = {**hf, "rope_parameters": params, "partial_rotary_factor": 1.0}
    fields = llama_like_model(plain, tie_default=False)
    fields["rope"] = {**fields["rope"], "partial_factor": float(partial)}
    fields.update(
        mlp_activation="swiglu",
        qk_norm=True,
        norm_offset=1.0,
        attn_output_gate=True,
        layer_pattern=pattern,
        linear_attention={
            "kind": "gated_deltanet",
            "num_k_heads": hf["linear_num_key_heads"],
            "num_v_heads": hf["linear_num_value_heads"],
            "k_head_dim": hf["linear_key_head_dim"],
            "v_head_dim": hf["linear_value_head_dim"],
            "conv_kernel": hf["linear_conv_kernel_dim"],
        },
    )
    experts = hf.get("num_experts", 0)
    if experts:
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            _fail(
                "Qwen3-Next with decoder_sparse_step != 1 or mlp_only_layers (dense blocks "
                "among MoE ones) is not supported: jaxllm's hybrid stack is all MoE or all dense."
            )
        fields["moe"] = {
            "num_experts": experts,
            "experts_per_token": hf["num_experts_per_tok"],
            "expert_mlp_dim": hf["moe_intermediate_size"],
            "num_shared_experts": 1,
            "shared_mlp_dim": hf["shared_expert_intermediate_size"],
            "shared_expert_gate": True,
            "router_score": "softmax",
            "normalize_top_k": bool(hf.get("norm_topk_prob", True)),
            "aux_loss_weight": float(hf.get("router_aux_loss_coef", 0.001)),
        }
    return fields


def _qwen3_next_hf(cfg: ModelConfig) -> dict:
    la, moe = cfg.linear_attention, cfg.moe
    if not la.enabled:
        _fail("a Qwen3-Next checkpoint needs linear layers (model.layer_pattern).")
    out = llama_like_hf(cfg)
    out["rope_parameters"] = {
        **out["rope_parameters"],
        "partial_rotary_factor": cfg.rope.partial_factor,
    }
    names = {v: k for k, v in TYPES.items()}
    reps = cfg.num_layers // len(cfg.layer_pattern)
    out.update(
        partial_rotary_factor=cfg.rope.partial_factor,
        layer_types=[names[k] for k in cfg.layer_pattern] * reps,
        attention_bias=False,
        linear_num_key_heads=la.num_k_heads,
        linear_num_value_heads=la.num_v_heads,
        linear_key_head_dim=la.k_head_dim,
        linear_value_head_dim=la.v_head_dim,
        linear_conv_kernel_dim=la.conv_kernel,
        num_experts=moe.num_experts,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    if moe.enabled:
        out.update(
            num_experts_per_tok=moe.experts_per_token,
            moe_intermediate_size=cfg.resolved_expert_mlp_dim,
            shared_expert_intermediate_size=moe.shared_mlp_dim
            or moe.num_shared_experts * cfg.resolved_expert_mlp_dim,
            norm_topk_prob=moe.normalize_top_k,
            router_aux_loss_coef=moe.aux_loss_weight,
            output_router_logits=False,
        )
    return out


def _links(cfg: ModelConfig, fused: bool = False) -> list[Link]:
    """Blocks numbered across the pattern: our `hybrid_layers/block_p` stack holds HF layers
    p, p + P, p + 2P, ... `fused`: transformers 5's in-memory experts
    (`save_original_format=False`), else one tensor per expert."""
    links = [
        Link("model.embed_tokens.weight", ("embed/embedding",)),
        Link("model.norm.weight", ("final_norm/scale",)),
    ]
    if not cfg.tie_embeddings:
        links.append(Link("lm_head.weight", ("lm_head",), "linear"))
    every, la = len(cfg.layer_pattern), cfg.linear_attention
    for p, kind in enumerate(cfg.layer_pattern):
        block = f"hybrid_layers/block_{p}/"
        a, m = block + "attn/", block + "mlp/"

        def link(hf, *ours, kind="same", cls=Link, **kw):
            return cls("model.layers.{i}." + hf, ours, kind, offset=p, stride=every, **kw)

        links += [
            link("input_layernorm.weight", block + "attn_norm/scale"),
            link("post_attention_layernorm.weight", block + "mlp_norm/scale"),
        ]
        if kind == "linear":
            qkvz = (a + "q_proj", a + "k_proj", a + "v_proj", a + "z_proj")
            conv = (a + "conv_q", a + "conv_k", a + "conv_v")
            g = la.num_k_heads
            links += [
                link(
                    "linear_attn.in_proj_qkvz.weight",
                    *qkvz,
                    kind="linear",
                    cls=GroupedLink,
                    groups=g,
                ),
                link(
                    "linear_attn.in_proj_ba.weight",
                    a + "b_proj",
                    a + "a_proj",
                    kind="linear",
                    cls=GroupedLink,
                    groups=g,
                ),
                link("linear_attn.conv1d.weight", *conv, kind="linear", cls=GroupedLink, conv=True),
                link("linear_attn.dt_bias", a + "dt_bias"),
                link("linear_attn.A_log", a + "A_log"),
                link("linear_attn.norm.weight", a + "norm_scale"),
                link("linear_attn.out_proj.weight", a + "out_proj", kind="linear", n_in=2),
            ]
        else:
            h = cfg.num_heads
            links += [
                link(
                    "self_attn.q_proj.weight",
                    a + "q_proj",
                    a + "gate_proj",
                    kind="linear",
                    cls=GroupedLink,
                    groups=h,
                ),
                link("self_attn.k_proj.weight", a + "k_proj", kind="linear"),
                link("self_attn.v_proj.weight", a + "v_proj", kind="linear"),
                link("self_attn.o_proj.weight", a + "o_proj", kind="linear", n_in=2),
                link("self_attn.q_norm.weight", a + "q_norm/scale"),
                link("self_attn.k_norm.weight", a + "k_norm/scale"),
            ]
        projections = ("gate", "up", "down")
        if not cfg.moe.enabled:
            links += [
                link(f"mlp.{x}_proj.weight", f"{m}{x}_proj", kind="linear") for x in projections
            ]
            continue
        links += [
            link("mlp.gate.weight", m + "router", kind="linear"),
            link("mlp.shared_expert_gate.weight", m + "shared_gate", kind="linear"),
            *(
                link(f"mlp.shared_expert.{x}_proj.weight", f"{m}shared/{x}_proj", kind="linear")
                for x in projections
            ),
        ]
        if fused:
            links += [
                link(
                    "mlp.experts.gate_up_proj",
                    m + "gate_proj",
                    m + "up_proj",
                    kind="linear",
                    axis=-2,
                    n_lead=1,
                ),
                link("mlp.experts.down_proj", m + "down_proj", kind="linear", n_lead=1),
            ]
        else:
            links += [
                link(f"mlp.experts.{{j}}.{x}_proj.weight", f"{m}{x}_proj", kind="linear")
                for x in projections
            ]
    return links


QWEN3_NEXT = Family(
    "qwen3_next",
    "Qwen3NextForCausalLM",
    _qwen3_next_model,
    _qwen3_next_hf,
    _links,
    other_links=(lambda c: _links(c, fused=True),),
)
