"""Hugging Face model families: `config.json` <-> `ModelConfig`, and tensor names <-> parameters.

A `Family` (`links.py`) knows one `model_type`: how its config.json maps to `ModelConfig` fields
(`to_model`, refusing with ConfigError what the knobs cannot express), the config.json of a
model (`to_hf`), and the `Link`s between its safetensors names and our parameter paths. Every
transform is a reshape, a transpose or a split/concatenation, so importing and exporting give
back the same bytes. The families live by group: `llama.py` (Llama, Mistral, Qwen2 / Qwen3,
Mixtral), `gemma.py` (Gemma 2, Gemma 3 text), `deepseek.py` (DeepSeek-V2, DeepSeek-V3),
`gpt_oss.py` (gpt-oss), `qwen3_next.py` (Qwen3-Next: hybrid linear attention),
`qwen2_5_vl.py` (Qwen2.5-VL: a vision tower and M-RoPE), `qwen3_vl.py` (Qwen3-VL, dense
and MoE: DeepStack, interleaved M-RoPE), `gpt2.py`, `bert.py` (BERT,
RoBERTa: encoders) and `t5.py` (T5 v1.0 / v1.1: encoder–decoders);
this module holds the registry `FAMILIES`, picks a model's family, and checks that an exported
config.json says what the model is.
"""

from __future__ import annotations

import dataclasses
import math

from jaxllm import config as config_lib
from jaxllm.config import ConfigError, EncoderConfig, ModelConfig, MoEConfig, RopeConfig
from jaxllm.convert.bert import BERT, ROBERTA
from jaxllm.convert.config_map import _fail
from jaxllm.convert.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from jaxllm.convert.gemma import GEMMA2, GEMMA3
from jaxllm.convert.gpt2 import GPT2
from jaxllm.convert.gpt_oss import GPT_OSS
from jaxllm.convert.links import Family
from jaxllm.convert.llama import LLAMA, MISTRAL, MIXTRAL, QWEN2, QWEN3
from jaxllm.convert.qwen2_5_vl import QWEN2_5_VL
from jaxllm.convert.qwen3_next import QWEN3_NEXT
from jaxllm.convert.qwen3_vl import QWEN3_VL, QWEN3_VL_MOE
from jaxllm.convert.t5 import T5

# ModelConfig fields that are training or compute choices, not part of a checkpoint.
NOT_ARCHITECTURE = frozenset(
    {
        "dtype",
        "param_dtype",
        "matmul_dtype",
        "fp8_scaling",
        "fp8_amax_history",
        "scan_unroll",
        "remat",
        "attention_impl",
        "init_std",
        "dropout",
    }
)
# MoEConfig fields of the same kind: how experts are dispatched and the balancing losses.
MOE_NOT_ARCHITECTURE = frozenset(
    {"dispatch", "capacity_factor", "aux_loss_weight", "router_z_loss_weight", "bias_update_rate"}
)
# ModelConfig fields of the dense MLP, which a model whose every block is MoE does not use.
DENSE_MLP = frozenset({"mlp_dim", "mlp_activation", "gelu_approximate", "mlp_bias"})

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        *(LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, MIXTRAL, DEEPSEEK_V3, DEEPSEEK_V2, GPT2),
        GPT_OSS,
        *(BERT, ROBERTA),
        T5,
        QWEN3_NEXT,
        *(QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE),
    )
}


def family_of(hf: dict) -> Family:
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        _fail(f"model_type {kind!r} is not supported; supported: {', '.join(FAMILIES)}.")
    return FAMILIES[kind]


def model_fields(hf: dict, source="config.json") -> dict:
    """The ModelConfig fields of a config.json (architecture only). A key the family needs that
    the file (`source`) lacks, or a value of the wrong type, is a ConfigError naming it rather
    than a KeyError or TypeError from deep inside the mapping."""
    family = family_of(hf)
    try:
        return {**family.to_model(hf), **head_fields(hf, family)}
    except ConfigError:
        raise
    except KeyError as e:
        raise ConfigError(
            f"{source} has no {e.args[0]!r}, which a {family.name} config.json needs; use the "
            "model's complete config.json."
        ) from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise ConfigError(
            f"{source} holds a value of the wrong type or range ({first_line(e)}); compare it "
            "with the model's original config.json."
        ) from None


# A reward model's architecture: the family's `...ForCausalLM` with this ending instead.
SCORE_ARCHITECTURE = "ForSequenceClassification"


def architecture(cfg: ModelConfig, family: Family) -> str:
    """The `architectures` entry of `cfg` as `family`: its LM class, or for a reward model
    (`model.head=score`) the sequence classifier of the same body
    (`LlamaForSequenceClassification`)."""
    if cfg.head == "lm":
        return family.architecture
    return family.architecture.removesuffix("ForCausalLM").removesuffix("LMHeadModel") + (
        SCORE_ARCHITECTURE
    )


# A process reward model's architecture (`train.objective=prm`), with TRL's two labels; the
# families whose transformers class of that name is the generic one: the body, then `score`, a
# [num_labels, D] linear with a bias (none under token_classification_bias=false).
TOKEN_ARCHITECTURE = "ForTokenClassification"
TOKEN_CLASSIFIER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def is_token_classifier(hf: dict) -> bool:
    """Whether config.json's `architectures` name a `*ForTokenClassification` (a PRM)."""
    return any(str(n).endswith(TOKEN_ARCHITECTURE) for n in hf.get("architectures") or ())


def _labels(hf: dict) -> int:
    """transformers' rule: id2label's size, else num_labels, else its default of 2."""
    return len(hf["id2label"]) if hf.get("id2label") else hf.get("num_labels", 2)


def _token_head(hf: dict, family: Family) -> None:
    """Refuses a `*ForTokenClassification` that jaxllm's score head cannot hold."""
    name = hf["architectures"][0]
    if family.name not in TOKEN_CLASSIFIER_FAMILIES:
        _fail(
            f"{name}: jaxllm reads a process reward model's *ForTokenClassification for "
            f"{', '.join(TOKEN_CLASSIFIER_FAMILIES)}, not {family.name}."
        )
    if _labels(hf) != 2:
        _fail(
            f"{name} with {_labels(hf)} labels: a process reward model has two (TRL's: step "
            "wrong, step right), whose logit difference is jaxllm's step score."
        )


def head_fields(hf: dict, family: Family) -> dict:
    """`model.head` (and what a score head implies) from config.json's `architectures`: a
    `*ForSequenceClassification` with one label is a reward model, a `*ForTokenClassification`
    with two (`_token_head`) a process reward model, each without tied embeddings or a final
    logit cap (it has no LM head); other label counts are refused."""
    names = hf.get("architectures") or [family.architecture]
    if is_token_classifier(hf):
        _token_head(hf, family)
        bias = bool(hf.get("token_classification_bias", True))  # transformers' default: a bias
        return {
            "head": "score",
            "tie_embeddings": False,
            "final_soft_cap": None,
            "score_bias": bias,
        }
    if not any(str(n).endswith(SCORE_ARCHITECTURE) for n in names):
        return {}
    labels = _labels(hf)
    if labels != 1:
        _fail(
            f"{names[0]} with {labels} labels: jaxllm's score head gives one score "
            "(num_labels=1, a reward model)."
        )
    return {"head": "score", "tie_embeddings": False, "final_soft_cap": None}


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (ConfigError messages are one line)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def guess_family(cfg: ModelConfig) -> Family:
    """The family a model exports as when none is named: the one its knobs point to."""
    if cfg.kind == "encoder_decoder":
        return FAMILIES["t5"]
    if cfg.vision is not None and cfg.rope.mrope_interleaved:
        return FAMILIES["qwen3_vl_moe" if cfg.moe.enabled else "qwen3_vl"]
    if cfg.vision is not None:
        return FAMILIES["qwen2_5_vl"]
    if cfg.layer_pattern:
        return FAMILIES["qwen3_next"]
    if cfg.kind == "encoder":  # RoBERTa numbers its positions after padding_idx
        return FAMILIES["roberta" if cfg.encoder.position_offset else "bert"]
    if cfg.mla.enabled and cfg.moe.enabled and cfg.moe.router_score == "softmax":
        return FAMILIES["deepseek_v2"]
    if cfg.mla.enabled:
        return FAMILIES["deepseek_v3"]
    if cfg.moe.enabled and (cfg.attention_sinks or cfg.moe.expert_bias):
        return FAMILIES["gpt_oss"]
    if cfg.moe.enabled:
        return FAMILIES["mixtral"]
    if cfg.position == "learned":
        return FAMILIES["gpt2"]
    if cfg.norm_placement == "sandwich":  # Gemma 2 has neither QK-norm nor a local RoPE base
        gemma3 = cfg.rope.local_theta is not None or cfg.qk_norm
        return FAMILIES["gemma3_text" if gemma3 else "gemma2"]
    if cfg.qk_norm:
        return FAMILIES["qwen3"]
    if cfg.qkv_bias and not cfg.o_bias:
        return FAMILIES["qwen2"]
    if cfg.sliding_window is not None:
        return FAMILIES["mistral"]
    return FAMILIES["llama"]


def export_family(cfg: ModelConfig, name: str | None = None) -> Family:
    """The family an export writes: the one named (`--family`), else `guess_family`."""
    if name is None:
        return guess_family(cfg)
    if name not in FAMILIES:
        raise ConfigError(f"unknown family {name!r}; choose from {', '.join(FAMILIES)}.")
    return FAMILIES[name]


def hf_config(cfg: ModelConfig, family: Family) -> dict:
    """config.json of `cfg` as `family`; ConfigError naming the knobs the family cannot hold
    (found by reading the written config back and comparing)."""
    out = {
        "architectures": [architecture(cfg, family)],
        "model_type": family.name,
        **family.to_hf(cfg),
    }
    if cfg.head == "score":  # one label: num_labels=1
        out.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    try:
        fields = {**family.to_model(out), **head_fields(out, family)}
        back = config_lib.from_dict({"model": fields}).model
    except ConfigError as e:
        _fail(f"this model cannot be expressed in a {family.name} checkpoint: {e}")
    # the score bias is the export's to write (a PRM's token_classification_bias) or refuse
    diff = _differences(cfg, dataclasses.replace(back, score_bias=cfg.score_bias))
    if diff:
        _fail(
            f"{', '.join(diff)} cannot be expressed in a {family.name} checkpoint; export as "
            f"another family (--family) or change the model."
        )
    return out


def _differences(cfg: ModelConfig, back: ModelConfig) -> list[str]:
    """The architecture knobs of `cfg` that `back` (its config.json read back) lost."""
    skip = NOT_ARCHITECTURE | {"moe"}
    if not (_has_dense_blocks(cfg) or _has_dense_blocks(back)):
        skip |= DENSE_MLP
    diff = []
    for f in dataclasses.fields(ModelConfig):
        ours, theirs = getattr(cfg, f.name), getattr(back, f.name)
        if f.name == "rope":  # key by key, in its place
            diff += _section_differences("rope.", RopeConfig, ours, theirs, cfg)
        elif f.name == "encoder":  # the pooler is whether the files hold one
            skip_pooler = frozenset({"pooler"})
            diff += _section_differences("encoder.", EncoderConfig, ours, theirs, cfg, skip_pooler)
        elif f.name not in skip and not _same(f.name, ours, theirs, cfg):
            diff.append(f"model.{f.name}={ours!r}")
    if not (cfg.moe.enabled or back.moe.enabled):
        return diff
    if cfg.moe.enabled != back.moe.enabled:  # the other MoE knobs mean nothing to a dense side
        return [*diff, f"model.moe.num_experts={cfg.moe.num_experts}"]
    skip = MOE_NOT_ARCHITECTURE | {"router_bias"}
    if cfg.resolved_expert_mlp_dim == back.resolved_expert_mlp_dim:
        skip |= {"expert_mlp_dim"}
    diff += _section_differences("moe.", MoEConfig, cfg.moe, back.moe, cfg, skip)
    if cfg.moe.has_router_bias != back.moe.has_router_bias:  # a bias the family lacks, or needs
        rate = cfg.moe.bias_update_rate
        diff.append(
            f"model.moe.bias_update_rate={rate!r}"
            if rate > 0
            else f"model.moe.router_bias={cfg.moe.router_bias!r}"
        )
    return diff


def _section_differences(prefix: str, cls, ours, theirs, cfg: ModelConfig, skip=frozenset()):
    """`model.<prefix>KEY=value` for each key of a subsection that `theirs` does not match."""
    return [
        f"model.{prefix}{f.name}={getattr(ours, f.name)!r}"
        for f in dataclasses.fields(cls)
        if f.name not in skip
        and not _same(prefix + f.name, getattr(ours, f.name), getattr(theirs, f.name), cfg)
    ]


def _has_dense_blocks(cfg: ModelConfig) -> bool:
    moe = cfg.moe
    return not moe.enabled or moe.first_dense_layers > 0 or moe.moe_every > 1


def _same(key: str, a, b, cfg: ModelConfig) -> bool:
    """Whether `a` (ours) and `b` (read back) mean the same for the model key `key` (below
    `model.`, e.g. `rope.theta`)."""
    if key == "head_dim":
        return cfg.resolved_head_dim == (b or cfg.d_model // cfg.num_heads)
    if key == "vision" and a is not None and b is not None:  # pixel budgets: the processor's
        return dataclasses.replace(a, min_pixels=b.min_pixels, max_pixels=b.max_pixels) == b
    if key == "linear_attention":  # the chunk length is a compute choice
        return dataclasses.replace(a, chunk_size=b.chunk_size) == b
    if key == "moe.shared_mlp_dim":  # null: num_shared_experts x expert width
        width = cfg.moe.num_shared_experts * cfg.resolved_expert_mlp_dim
        return (a or width) == (b or width)
    if key == "rope.local_theta" and cfg.rope.scaling == "none":  # null: rope.theta
        return math.isclose(a or cfg.rope.theta, b or cfg.rope.theta)
    if key == "max_seq_len" and cfg.rope.scaling == "dynamic" and cfg.position == "rope":
        return True  # a `dynamic` config.json has no context limit: its max is the original
    if key == "rope.original_max_len":
        return (a or cfg.max_seq_len) == (b or cfg.max_seq_len)
    if key == "attn_scale":
        default = (cfg.mla.qk_head_dim if cfg.mla.enabled else cfg.resolved_head_dim) ** -0.5
        return math.isclose(a or default, b or default)
    if key.startswith("rope.") and cfg.position != "rope":
        return True
    if key == "moe.group_score" and cfg.moe.groups_per_token == cfg.moe.num_groups:
        return True  # no group limit: how groups would be ranked does not matter
    if key == "gelu_approximate" and cfg.mlp_activation not in ("gelu", "geglu"):
        return True
    if key == "global_every" and cfg.sliding_window is None:
        return True
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b
