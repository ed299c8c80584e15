"""LoRA adapters in and out of Hugging Face PEFT's layout: the `adapter_config.json` and
`adapter_model.safetensors` that `peft.PeftModel.save_pretrained` writes and
`PeftModel.from_pretrained` reads (`export_peft`, `import_peft`).

PEFT gives every adapted torch module two Linear layers, `lora_A` from the module's inputs to
r and `lora_B` from r to its outputs, saved as `base_model.model.<module>.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]. Each factor here travels through the family's own
`Link` of its weight (`jaxllm.convert`), so the names and the reshape / transpose are the base
export's: A [*lead, *in, r] maps like its weight with r as the output, B [*lead, r, *out]
like a weight with the single input r, and whatever the weight's link does to its input dims
it does to A's, to its output dims to B's. A weight whose Hugging Face side is not one Linear
(or GPT-2 Conv1D) module per layer has no PEFT layout: transformers keeps a layer's routed
experts in one fused parameter, and GPT-2 fuses q, k and v into `c_attn`.

Both directions write their output whole or not at all (`jaxllm.config.outputs.written`, as
`jaxllm.convert` does): an adapter directory or run directory that already holds files is
refused before anything is read, unless `overwrite`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from jaxllm import checkpoint, sharding
from jaxllm import config as config_lib
from jaxllm.adapters.peft_parts import (
    CONFIG_FILE,
    PREFIX,
    TIED_HEAD,
    layer_list,
    left_out,
    module_of,
    saved_links,
    saved_names,
)
from jaxllm.config import ConfigError, ModelConfig, PeftConfig
from jaxllm.config.outputs import check_output, written
from jaxllm.convert import is_hf_dir, load_params
from jaxllm.convert.export import OUT_FLAG, library_os_errors
from jaxllm.convert.families import export_family, family_of, hf_config, model_fields
from jaxllm.convert.hf import OUT_FLAG as RUN_FLAG
from jaxllm.convert.hf import check_out_dir, new_run
from jaxllm.convert.links import Family, Link
from jaxllm.convert.mapping import Mapped, each, element_shapes, flatten, unflatten
from jaxllm.convert.reader import Reader, read_hf_config, read_json
from jaxllm.load import BASE_ITEM, base_record, check_base
from jaxllm.model import abstract_model, abstract_model_state
from jaxllm.model.peft_parts import SAVED

WEIGHTS_FILE = "adapter_model.safetensors"
A, B, M = "_lora_a", "_lora_b", "_lora_magnitude"

# adapter_config.json keys for PEFT features jaxllm's LoRA does not have, with the value that
# means "not used" (null, false, {} or [] count as unused too).
UNUSED = {
    "bias": "none",
    "lora_bias": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "target_parameters": None,
    "trainable_token_indices": None,
    "use_qalora": False,
}


# Module names that PEFT (0.21, with transformers 5) takes for the routed experts' fused
# parameters in these families, whatever module they name (it rewrites them into
# `target_parameters`): adapters of DeepSeek's dense and shared-expert MLPs cannot be loaded
# under them.
EXPERT_NAMES = {
    "deepseek_v2": ("gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("gate_proj", "up_proj", "down_proj"),
}


def _leaf(link: Link) -> str:
    """The module's own name, as target_modules names it (`q_proj`)."""
    return module_of(link).rsplit(".", 1)[-1]


def _factor_links(link: Link, dora: bool) -> tuple[Link, ...]:
    """The links of A and B (and DoRA's magnitude) for the weight of `link`: PEFT's lora_A /
    lora_B are torch Linear layers ([out, in]) whatever the module's own kind, and
    lora_magnitude_vector [out] is the flattened output dims of the weight."""
    module, path = PREFIX + module_of(link), link.ours[0]
    a = dataclasses.replace(link, hf=module + ".lora_A.weight", ours=(path + A,), kind="linear")
    b = dataclasses.replace(
        link, hf=module + ".lora_B.weight", ours=(path + B,), kind="linear", n_in=1
    )
    m = dataclasses.replace(
        link, hf=module + ".lora_magnitude_vector", ours=(path + M,), kind="flat"
    )
    return (a, b, m) if dora else (a, b)


def _adaptable(family: Family, cfg: ModelConfig) -> list[Link]:
    """The family's weight links that PEFT can adapt: each one torch Linear (or GPT-2 Conv1D)
    module per layer; not fused weights, not routed experts, not `EXPERT_NAMES`."""
    return [
        link
        for link in family.links(cfg)
        if len(link.ours) == 1
        and link.kind in ("linear", "conv")
        and link.n_lead == 0
        and link.hf.endswith(".weight")
        and "j" not in link.indices
        and _leaf(link) not in EXPERT_NAMES.get(family.name, ())
    ]


def factor_links(
    cfg: ModelConfig, family: Family, adapted: set[str], dora: bool = False
) -> tuple[list[Link], list[Link], list[str]]:
    """(the adapted weights' links, their A and B (and magnitude) links, the adapted weights
    without a PEFT layout) for our weight paths `adapted`."""
    weights = [link for link in _adaptable(family, cfg) if link.ours[0] in adapted]
    links = [f for w in weights for f in _factor_links(w, dora)]
    return weights, links, sorted(adapted - {w.ours[0] for w in weights})


def target_modules(cfg: ModelConfig, family: Family, weights: list[Link], shapes) -> list[str]:
    """target_modules for the adapted `weights`: PEFT adapts every module whose name is, or
    ends with, an entry, so a module's own name (`q_proj`) where every module of that name is
    adapted here, else the full names of the adapted ones (GPT-2's `c_proj` is both the
    attention output and the MLP down projection)."""
    adapted = {module_of(w) for w in weights}
    out = set()
    for w in weights:
        alike = [link for link in _adaptable(family, cfg) if _leaf(link) == _leaf(w)]
        if all(module_of(link) in adapted for link in alike):
            out.add(_leaf(w))
        else:
            out |= {w.name(i).removesuffix(".weight") for i in each(w, shapes)}
    return sorted(out)


def adapter_config(peft: PeftConfig, modules: list[str], base: str | None, conv: bool) -> dict:
    """adapter_config.json of a LoRA on the torch modules named `modules` (PEFT matches a
    module whose name is, or ends with, one of them) of the model at `base`. `conv`: the
    adapted modules are GPT-2 Conv1D ([in, out] weights), which PEFT wants said."""
    alpha = float(peft.alpha)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": peft.rank,
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "lora_dropout": peft.dropout,
        "use_rslora": peft.rslora,
        "use_dora": peft.dora,
        "layers_to_transform": list(peft.layers_to_transform) or None,
        "target_modules": modules,
        "fan_in_fan_out": conv,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "revision": None,
        **UNUSED,
    }


def export_peft(
    adapters: dict,
    cfg: config_lib.Config,
    out_dir,
    family: str | None = None,
    base: dict | None = None,
    overwrite: bool = False,
) -> list[Mapped]:
    """`jaxllm convert export --peft`: writes the LoRA `adapters` (a nested dict of arrays,
    possibly sharded) of a run with config `cfg` as adapter_config.json and
    adapter_model.safetensors into `out_dir`, in the family's names (`family`, else the one
    the model's knobs point to). `base`: the run's base record, whose source becomes
    base_model_name_or_path when it is a Hugging Face directory. An `out_dir` that holds
    files is refused, or with `overwrite` replaced once the new one is complete."""
    check_output(out_dir, flag=OUT_FLAG, overwrite=overwrite)
    if not cfg.peft.lora:
        raise ConfigError(
            f"--peft exports LoRA adapters, and this run has peft.method={cfg.peft.method}; "
            "export it without --peft."
        )
    m = dataclasses.replace(cfg.model, value_head=False)  # PPO's value head: no PEFT layout
    fam = export_family(m, family)
    hf_config(m, fam)  # the model must be one the family can hold, as for the base export
    flat = flatten({k: v for k, v in adapters.items() if k != "value"})
    adapted = {p.removesuffix(A) for p in flat if p.endswith(A)}
    if not adapted:
        raise ConfigError("this run's checkpoint holds no LoRA adapters; nothing to export.")
    weights, links, unmapped = factor_links(m, fam, adapted, cfg.peft.dora)
    if unmapped:
        raise ConfigError(
            f"the adapters of {', '.join(unmapped)} have no Hugging Face PEFT layout in a "
            f"{fam.name} checkpoint (PEFT adapts one Linear module per weight: transformers "
            "fuses routed experts, GPT-2's q, k, v in c_attn, and PEFT takes DeepSeek's "
            "gate_proj / up_proj / down_proj for its experts); export with --merge instead, or "
            "train without them (peft.targets)."
        )
    shapes = {p: tuple(a.shape) for p, a in flat.items()}
    modules = target_modules(m, fam, weights, {w.ours[0]: shapes[w.ours[0] + A] for w in weights})
    tensors, report = {}, []
    for link in links:
        for index in each(link, shapes):  # one layer at a time to the host
            if left_out(link, index, cfg.peft.layers_to_transform):
                continue
            x = np.asarray(jax.device_get(flat[link.ours[0]][index]))
            tensors[link.name(index)] = link.to_hf([x])
        report.append(Mapped.of(link, shapes, str(flat[link.ours[0]].dtype)))
    source = (base or {}).get("source")
    conv = any(w.kind == "conv" for w in weights)
    hf_base = source if source and is_hf_dir(source) else None
    settings = adapter_config(cfg.peft, modules, hf_base, conv)
    saved = saved_links(m, fam, cfg.peft.modules_to_save)
    for link in saved:
        tensors[link.hf] = link.to_hf([np.asarray(jax.device_get(flat[link.ours[0]]))])
        report.append(Mapped.of(link, shapes, str(flat[link.ours[0]].dtype)))
    embed = [link.hf for link in saved if link.ours == ("/".join(SAVED["embed_tokens"]),)]
    if m.tie_embeddings and embed:  # PEFT's tied head: the saved embeddings again
        tensors[TIED_HEAD] = tensors[embed[0]]
    if saved:  # PEFT's names of the modules: their own (`embed_tokens`, `lm_head`)
        settings["modules_to_save"] = [_leaf(link) for link in saved]
        settings["ensure_weight_tying"] = m.tie_embeddings
    with written(out_dir, flag=OUT_FLAG, overwrite=overwrite) as tmp, library_os_errors(tmp):
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    return report


def read_adapter_config(adapter_dir: Path) -> dict:
    """adapter_config.json of a PEFT LoRA directory, refused in one line where it asks for
    what jaxllm's LoRA cannot do."""
    path = adapter_dir / CONFIG_FILE
    if not path.is_file() or not (adapter_dir / WEIGHTS_FILE).is_file():
        raise ConfigError(
            f"{adapter_dir} has no {CONFIG_FILE} and {WEIGHTS_FILE}; give the directory "
            "peft's save_pretrained wrote (adapter_model.bin: save it again with "
            "safe_serialization=True)."
        )
    hf = read_json(path)
    if not isinstance(hf, dict) or hf.get("peft_type") != "LORA":
        kind = hf.get("peft_type") if isinstance(hf, dict) else None
        raise ConfigError(f"{path} is not a LoRA adapter (peft_type {kind!r}); give a LORA one.")
    if hf.get("task_type") not in (None, "CAUSAL_LM"):
        raise ConfigError(
            f"{path} has task_type {hf['task_type']!r}; jaxllm imports CAUSAL_LM adapters."
        )
    for key, unused in UNUSED.items():
        value = hf.get(key, unused)
        if value != unused and value not in (None, False, {}, []):
            raise ConfigError(
                f"{path} sets {key}={value!r}, which jaxllm's LoRA has no equivalent for; "
                f"import an adapter trained without it ({key}={unused!r})."
            )
    return hf


def _peft_overrides(hf: dict, modules: set[str], family: Family, cfg: ModelConfig) -> list[str]:
    """peft.* overrides of an adapter config whose file adapts the torch modules `modules`
    (full names): the jaxllm target of every family weight PEFT adapted in some layer."""
    targets = set()
    for link in _adaptable(family, cfg):
        pattern = re.escape(module_of(link)).replace(re.escape("{i}"), r"\d+")
        if any(re.fullmatch(pattern, m) for m in modules):
            tower = "visual." if link.ours[0].startswith("visual/") else ""  # peft.targets
            targets.add(tower + link.ours[0].rsplit("/", 1)[-1])
    if not targets:
        raise ConfigError(
            f"the adapter holds no LoRA factors of a {family.name} weight jaxllm can adapt "
            f"(its modules: {', '.join(sorted(modules)[:3]) or 'none'}); is it for this base?"
        )
    alpha, rank = hf.get("lora_alpha", 8), hf.get("r", 8)
    return [
        "peft.method=lora",
        f"peft.rank={rank}",
        f"peft.alpha={float(alpha)}",
        f"peft.dropout={float(hf.get('lora_dropout') or 0.0)}",
        f"peft.rslora={str(bool(hf.get('use_rslora'))).lower()}",
        f"peft.dora={str(bool(hf.get('use_dora'))).lower()}",
        f"peft.layers_to_transform=[{','.join(map(str, layer_list(hf)))}]",
        f"peft.targets=[{','.join(sorted(targets))}]",
    ]


def import_peft(
    hf_dir, adapter_dir, out_dir, overrides=(), mesh=None, overwrite=False
) -> list[Mapped]:
    """`jaxllm convert import HF_DIR OUT_DIR --peft ADAPTER_DIR`: a PEFT run directory whose
    base is the Hugging Face model `hf_dir` (`checkpoint.init_from`) and whose step-0
    checkpoint holds the LoRA adapters of `adapter_dir` with the record of that base, so that
    `load_model`, `generate` and `eval` apply them and `train` goes on training them. The
    peft.* keys come from adapter_config.json (`overrides` after them). Every check happens
    before anything is written, that of `out_dir` first (`jaxllm.convert.hf.new_run`)."""
    hf_dir, adapter_dir = Path(hf_dir).resolve(), Path(adapter_dir)
    reads = (hf_dir, adapter_dir)
    check_out_dir(out_dir, flag=RUN_FLAG, overwrite=overwrite, reads=reads)
    hf = read_adapter_config(adapter_dir)
    family = family_of(read_hf_config(hf_dir))
    reader = Reader(adapter_dir)
    suffix = ".lora_A.weight"
    modules = {
        n[len(PREFIX) : -len(suffix)]
        for n in reader.shapes
        if n.startswith(PREFIX) and n.endswith(suffix)
    }
    plain = config_lib.from_dict({"model": model_fields(read_hf_config(hf_dir))}).model
    peft = _peft_overrides(hf, modules, family, plain)
    peft.append(f"peft.modules_to_save=[{','.join(saved_names(hf, family, plain))}]")
    overrides = [f"checkpoint.init_from={hf_dir}", *peft, *overrides]
    new = new_run(hf_dir, out_dir, overrides, overwrite=overwrite, reads=reads)
    cfg = new.cfg
    if not cfg.peft.lora:
        raise ConfigError(
            f"importing a LoRA adapter needs peft.method lora or qlora, not {cfg.peft.method}."
        )
    _, abstract, axes = abstract_model(cfg.model, cfg.peft)
    flat_abstract = flatten(abstract)
    shapes = {p: tuple(a.shape) for p, a in flat_abstract.items()}
    adapted = {p.removesuffix(A) for p in shapes if p.endswith(A)}
    _, links, unmapped = factor_links(cfg.model, family, adapted, cfg.peft.dora)
    if unmapped:
        raise ConfigError(
            f"with peft.targets={list(cfg.peft.targets)} jaxllm also adapts "
            f"{', '.join(unmapped)}, which PEFT cannot (no Linear module per weight in "
            "transformers); this adapter cannot be imported as it is."
        )
    links += saved_links(cfg.model, family, cfg.peft.modules_to_save)
    tied_head = cfg.model.tie_embeddings and "embed_tokens" in cfg.peft.modules_to_save
    layers = cfg.peft.layers_to_transform
    ignored = {TIED_HEAD} if tied_head else set()
    _check_names(reader, links, shapes, adapter_dir, ignored, layers)
    mesh = mesh or sharding.make_mesh(cfg.mesh)
    flat_sh = flatten(sharding.tree_shardings(mesh, axes))
    out = {}
    for link in links:
        p = link.ours[0]
        element = element_shapes(link, shapes)
        zeros = np.zeros(element[0], flat_abstract[p].dtype)  # a layer PEFT does not adapt
        parts = [
            zeros
            if left_out(link, i, layers)
            else link.to_ours(reader.read(link.name(i)), element)[0]
            for i in each(link, shapes)
        ]
        x = np.stack(parts).reshape(shapes[p]).astype(flat_abstract[p].dtype)
        out[p] = jax.device_put(x, flat_sh[p])
    model_state = None
    if flatten(abstract_model_state(cfg.model)[0]):  # routing biases: the base's own
        model_state = load_params(hf_dir, cfg.model, mesh)[1]
    report = [Mapped.of(link, shapes, str(flat_abstract[link.ours[0]].dtype)) for link in links]
    new.write(unflatten(out), model_state, base=base_record(cfg))
    return report


def _check_names(
    reader: Reader,
    links: list[Link],
    shapes: dict,
    adapter_dir: Path,
    ignored=frozenset(),
    layers: tuple[int, ...] = (),
) -> None:
    """ConfigError naming the first mismatches between the adapter file and the factors the
    run expects: missing tensors (a layer PEFT left out), shapes, tensors that map to none
    (but those `ignored`: the LM head PEFT saves beside tied embeddings, the same matrix)."""
    errors, expected = [], set()
    for link in links:
        want = link.hf_shape(element_shapes(link, shapes))
        for index in each(link, shapes):
            if left_out(link, index, layers):
                continue
            name = link.name(index)
            expected.add(name)
            if name not in reader.shapes:
                errors.append(f"missing tensor {name}")
            elif reader.shapes[name] != want:
                errors.append(f"{name} has shape {list(reader.shapes[name])}, not {list(want)}")
    extra = sorted(set(reader.shapes) - expected - set(ignored))
    errors += [f"tensor {n} maps to no adapter" for n in extra]
    if errors:
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise ConfigError(
            f"cannot import the adapter in {adapter_dir}: {'; '.join(errors[:3])}{more}; jaxllm "
            "adapts a target name's weight in every layer (or those of layers_to_transform), "
            "with one rank and alpha."
        )


def imported_adapters(ckpt_dir: Path, target, base: dict | None):
    """The adapters a PEFT run starts from when its own directory holds a weights-only
    checkpoint of them with a base record (`jaxllm convert import --peft`), restored into
    `target` (their abstract arrays with shardings, `jaxllm.load.weight_targets`); None
    otherwise (they start fresh). RunError when that checkpoint's base is not `base`."""
    found = checkpoint.steps(ckpt_dir)
    if base is None or not found or checkpoint.has_train_state(ckpt_dir, found[-1]):
        return None
    recorded = checkpoint.read_json_item(ckpt_dir, found[-1], BASE_ITEM)
    if recorded is None:  # an imported base (`jaxllm convert import`), not adapters
        return None
    check_base(recorded, base)
    return checkpoint.restore_weights(ckpt_dir, target, step=found[-1]).params
