"""The parts of a Hugging Face PEFT LoRA adapter beside its factors (`hf_peft`): the whole
weights of `modules_to_save` (saved under the base weight's own name behind PEFT's prefix) and
the layers of `layers_to_transform`."""

from __future__ import annotations

import dataclasses

from jaxllm.config import ConfigError, ModelConfig
from jaxllm.convert.links import Family, Link
from jaxllm.model.peft_parts import SAVED

CONFIG_FILE = "adapter_config.json"
PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
TIED_HEAD = PREFIX + "lm_head.weight"  # PEFT's copy of saved tied embeddings (ensure_weight_tying)


def module_of(link: Link) -> str:
    """The torch module of a weight's link (`model.layers.{i}.self_attn.q_proj`)."""
    return link.hf.removesuffix(".weight")


def saved_links(cfg: ModelConfig, family: Family, names) -> list[Link]:
    """The links of the whole weights `peft.modules_to_save` names, which PEFT saves under the
    base weight's own name behind its prefix (`base_model.model.lm_head.weight`)."""
    links = {link.ours[0]: link for link in family.links(cfg) if len(link.ours) == 1}
    out = []
    for name in names:
        link = links.get("/".join(SAVED[name]))
        if link is None or link.indices:
            raise ConfigError(
                f"peft.modules_to_save: {name} has no Hugging Face layout in a {family.name} "
                "checkpoint of this model."
            )
        out.append(dataclasses.replace(link, hf=PREFIX + link.hf))
    return out


def saved_names(hf: dict, family: Family, cfg: ModelConfig) -> list[str]:
    """jaxllm's names (`peft.modules_to_save`) of the adapter's modules_to_save: PEFT's match a
    module whose name is, or ends with, one of them."""
    modules = {}
    for ours, path in SAVED.items():
        link = next((x for x in family.links(cfg) if x.ours == ("/".join(path),)), None)
        if link is not None:
            modules[ours] = module_of(link)
    out = []
    tied = cfg.tie_embeddings and hf.get("ensure_weight_tying")
    for name in hf.get("modules_to_save") or []:
        if tied and name == "lm_head":  # PEFT's tied copy of the saved embeddings
            name = modules["embed_tokens"]
        found = [o for o, m in modules.items() if m == name or m.endswith("." + name)]
        if not found:
            raise ConfigError(
                f"the adapter's modules_to_save names {name!r}, which is none of this "
                f"{family.name} model's {', '.join(sorted(modules.values()))}."
            )
        out += found
    if "embed_tokens" in out and cfg.tie_embeddings and not hf.get("ensure_weight_tying"):
        raise ConfigError(
            "the adapter trains a copy of the tied embeddings (modules_to_save without "
            "ensure_weight_tying), which PEFT uses for the input only; jaxllm's tied model "
            "has one matrix for both, so this adapter cannot be imported as it is."
        )
    return sorted(set(out))


def layer_list(hf: dict) -> list[int]:
    """adapter_config.json's layers_to_transform as a list (PEFT takes one int or a list)."""
    value = hf.get("layers_to_transform")
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return value
    raise ConfigError(
        f"layers_to_transform={value!r} in {CONFIG_FILE} is not a layer number or a list of them."
    )


def left_out(link: Link, index: tuple, layers: tuple[int, ...]) -> bool:
    """Whether the tensor `index` of `link` is of a layer `peft.layers_to_transform` leaves out
    (our k-th stacked layer is HF layer offset + k * stride)."""
    if not layers or link.indices[:1] != ("i",):
        return False
    return index[0] * link.stride + link.offset not in layers
