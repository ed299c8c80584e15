"""The frozen companion models beside the one that trains: the reference of the DPO family (and
of GRPO / PPO's KL), the teacher of distillation, the reward model that scores GRPO / PPO
rollouts; which a run holds, where each comes from, their shardings, loading and records.

An objective that needs them names them in a function attribute, `objective.others =
("reference",)`, and is then called `objective(model, batch, rng, others)` with `others` a
dict of name -> `nnx.Module`. Their parameters travel in `TrainState.others` as
{name: {"params", "model_state"}}, sharded on the run's mesh by their own logical axes, so a
teacher wider or deeper than the student shards like any model; the step differentiates only
`TrainState.params`, so nothing flows into them. Like the PEFT base they are never
checkpointed: a run records where each came from with a content hash (the checkpoint's
`others` item) and loads them again at resume, refusing different weights in one line.

The reward models are not the objective's: a rollout objective whose `train.reward` (or an
entry of `train.rewards`) is a directory holds it (`held_names`), and the rollouts (`jaxllm.objectives.rollout.sampling`) read
it from the state.

Where each comes from (`source_of`): `train.teacher`; `train.reward`; `train.reference`, else the run's
starting point `checkpoint.init_from`. Under `peft` with no `train.reference` the reference is
the policy's own frozen base with its adapters zeroed, W + s A 0 = W (as PEFT's
`disable_adapter`), so no second copy is held: it has no entry in `TrainState.others`. That base
is the starting point, even when it is a fine-tuning run's merged model
(`jaxllm.adapters.chain`). A run that continues a fine-tuning run's adapters
(`checkpoint.init_adapters=continue`) starts from the base with those adapters: its reference
holds only them (`Other.peft`), applied to the policy's base. Any other source that is itself a
PEFT run counts as its merged model (base + adapters).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm import checkpoint, config
from jaxllm.adapters.chain import adapters_of, continued
from jaxllm.config import Config, ConfigError, ModelConfig, PeftConfig, QuantizeConfig, RunError
from jaxllm.config.train import ROLLOUT_OBJECTIVES
from jaxllm.convert import is_hf_dir, load_params
from jaxllm.load import (
    content_hash,
    merged_weights,
    model_section,
    resolve,
    restore,
    weight_files,
    weight_targets,
)
from jaxllm.model import abstract_model, merge_model
from jaxllm.objectives import from_config
from jaxllm.objectives.distill import check_teacher, feature_layers
from jaxllm.objectives.rollout.rewards import model_sources

OTHERS_ITEM = "others"  # the checkpoint's JSON item: {name: {"source", "sha256"}}


class Other(NamedTuple):
    """One frozen model: where its weights are (None: the policy's base, adapters off) and its
    model section; with `peft`, only the adapters (soft prompt) of `source`, applied to the
    policy's own base. A quantized run is held as it is stored, its matmul weights in packed
    codes (`quantize`), computed by the model's matmul seam like any quantized run's."""

    source: str | None
    model: ModelConfig
    peft: PeftConfig | None = None
    quantize: QuantizeConfig | None = None  # a quantized run's packing (`jaxllm quantize`)


def names(objective) -> tuple[str, ...]:
    """The frozen models `objective` asks for."""
    return tuple(getattr(objective, "others", ()))


def held_names(cfg: Config, objective) -> tuple[str, ...]:
    """The frozen models of this run: the objective's, and a rollout's reward models."""
    rollout = cfg.train.objective in ROLLOUT_OBJECTIVES
    return names(objective) + (tuple(model_sources(cfg.train)) if rollout else ())


def source_of(cfg: Config, name: str) -> str | None:
    """Where the frozen model `name` of this run comes from (see the module docstring)."""
    peft = cfg.peft.method != "none"
    if name == "teacher":
        if not cfg.train.teacher:
            raise ConfigError(f"train.objective={cfg.train.objective} needs train.teacher.")
        return cfg.train.teacher
    if name.startswith("reward_model"):
        return model_sources(cfg.train)[name]
    if name == "reference":
        if cfg.train.reference:
            return cfg.train.reference
        if peft and continued(cfg) is not None:  # the base with the adapters it starts from
            return cfg.checkpoint.init_from
        if peft:
            if cfg.peft.method == "prompt":
                raise ConfigError(
                    f"train.objective={cfg.train.objective} under peft.method=prompt needs a "
                    "reference model: set train.reference (a soft prompt cannot be switched "
                    "off inside the policy)."
                )
            return None
        if not cfg.checkpoint.init_from:
            raise ConfigError(
                f"train.objective={cfg.train.objective} compares the policy with a reference "
                "model: set checkpoint.init_from (the reference is then the starting point) or "
                "train.reference."
            )
        return cfg.checkpoint.init_from
    raise ConfigError(f"the objective asks for an unknown frozen model {name!r}.")


def _key(cfg: Config, name: str) -> str:
    if name == "reference" and not cfg.train.reference:
        return "checkpoint.init_from"
    if name == "reward_model":
        return "train.reward"
    if name.startswith("reward_model_"):
        return f"train.rewards[{name.rpartition('_')[2]}].model"
    return f"train.{name}"


def resolve_others(cfg: Config, objective) -> dict[str, Other]:
    """The frozen models of this run (`held_names`), checked: each must share the policy's
    vocabulary, a reward model must have a score head (ConfigError before anything is
    compiled)."""
    out = {}
    for name in held_names(cfg, objective):
        source = source_of(cfg, name)
        if source is None:
            out[name] = Other(None, cfg.model)
            continue
        if name == "reference" and not cfg.train.reference and cfg.peft.method != "none":
            out[name] = Other(source, cfg.model, cfg.peft)  # continued adapters
            continue
        model = model_section(source, _key(cfg, name))
        if name == "teacher":  # its vocabulary and the length of the rows it will read
            check_teacher(cfg.model, model, source, cfg.data.seq_len)
            if cfg.train.distill_hidden_weight > 0:  # and its blocks that are matched
                feature_layers(cfg.model, model, cfg.train.distill_layers, source)
        if name.startswith("reward_model"):
            _check_reward_model(model, source, cfg.data.seq_len, _key(cfg, name))
        if model.vocab_size != cfg.model.vocab_size:
            raise ConfigError(
                f"{_key(cfg, name)}={source} has a vocabulary of {model.vocab_size} ids and this "
                f"model {cfg.model.vocab_size}; the {name} must share the trained model's "
                "vocabulary (and tokenizer)."
            )
        out[name] = Other(source, model, quantize=_packing(source))
    return out


def with_features(cfg: Config) -> Config:
    """`cfg` with feature distillation's layer map and projections filled in from the teacher
    (`train.distill_hidden_weight` > 0; else `cfg` itself): `train.distill_layers` the pairs
    given or the default map, `model.distill_proj` [pairs, the teacher's d_model]. What
    config.yaml then records, so the run's own model (load_model, generate, eval) has the
    projections its checkpoints hold. ConfigError before anything is written for a pair
    outside either stack or a `model.distill_proj` set to other sizes."""
    t = cfg.train
    if t.objective != "distill" or t.distill_hidden_weight == 0:
        return cfg
    teacher = model_section(source_of(cfg, "teacher"), "train.teacher")
    pairs = feature_layers(cfg.model, teacher, t.distill_layers, t.teacher)
    proj = (len(pairs), teacher.d_model)
    if cfg.model.distill_proj not in ((), proj):
        raise ConfigError(
            f"model.distill_proj={list(cfg.model.distill_proj)} but feature distillation from "
            f"train.teacher={t.teacher} needs {list(proj)} ({len(pairs)} layer pairs, the "
            "teacher's d_model); set model.distill_proj=[] to have it filled."
        )
    model = dataclasses.replace(cfg.model, distill_proj=proj)
    return dataclasses.replace(cfg, model=model, train=dataclasses.replace(t, distill_layers=pairs))


def _packing(source: str) -> QuantizeConfig | None:
    """The `quantize` section of a quantized run `source` (None for any other model; a
    fine-tuning run's merged model is plain weights even on a quantized base)."""
    if is_hf_dir(source):
        return None
    theirs = config.load(resolve(source)[0] / "config.yaml")
    return theirs.quantize if theirs.quantize.enabled and theirs.peft.method == "none" else None


def _check_reward_model(model: ModelConfig, source: str, seq_len: int, key: str) -> None:
    if model.head != "score":
        raise ConfigError(
            f"{key}={source} is a language model, not a reward model: train one with "
            "train.objective=reward (model.head=score) or import a *ForSequenceClassification."
        )
    if model.max_seq_len < seq_len:
        raise ConfigError(
            f"{key}={source} reads at most {model.max_seq_len} positions "
            f"(model.max_seq_len), fewer than the rows' data.seq_len={seq_len}; lower data.seq_len."
        )


def graphdefs(others: dict[str, Other]) -> dict:
    """name -> the nnx graph of each held model (not of the policy's own base)."""
    return {
        n: abstract_model(o.model)[0]
        for n, o in others.items()
        if o.source is not None and o.peft is None
    }


def _targets(other: Other, mesh: Mesh) -> dict:
    if other.peft is not None:  # the adapters alone (a value head is the policy's business)
        params = weight_targets(other.model, mesh, other.peft)[1]
        return {"params": {k: v for k, v in params.items() if k != "value"}, "model_state": {}}
    _, params, model_state = weight_targets(other.model, mesh, quantize=other.quantize)
    return {"params": params, "model_state": model_state}


def shardings(others: dict[str, Other], mesh: Mesh) -> dict | None:
    """NamedShardings of `TrainState.others` (None when no model is held)."""
    held = {n: o for n, o in others.items() if o.source is not None}
    if not held:
        return None
    return {n: jax.tree.map(lambda t: t.sharding, _targets(o, mesh)) for n, o in held.items()}


def load(others: dict[str, Other], mesh: Mesh) -> dict | None:
    """`TrainState.others`: each held model's weights in its shards on `mesh`."""
    out = {}
    for name, other in others.items():
        if other.source is None:
            continue
        if other.peft is not None:  # the starting adapters: the policy's base goes under them
            cfg = config.Config(model=other.model, peft=other.peft)
            theirs = config.load(resolve(other.source)[0] / "config.yaml")
            params = adapters_of(other.source, cfg, theirs, mesh)[0]
            params.pop("value", None)
            model_state = {}
        elif is_hf_dir(other.source):
            params, model_state, _ = load_params(other.source, other.model, mesh)
        else:
            restored = restore(other.source, mesh=mesh)
            params, model_state = restored.params, restored.model_state
            if restored.frozen is not None:  # a PEFT run: its merged model
                params = merged_weights(restored, _targets(other, mesh)["params"])
        out[name] = {"params": params, "model_state": model_state or {}}
    return out or None


def records(others: dict[str, Other]) -> dict | None:
    """{name: {"source", "sha256"}} of the held models: what the checkpoints record."""
    out = {}
    for name, other in others.items():
        if other.source is not None:
            source, files = weight_files(Path(other.source).resolve())
            out[name] = {"source": str(source), "sha256": content_hash(files, source)}
    return out or None


def check(recorded: dict | None, current: dict | None) -> None:
    """RunError when a resumed run's frozen models are other weights than it trained with."""
    for name, was in (recorded or {}).items():
        now = (current or {}).get(name)
        if now is None or now["sha256"] != was["sha256"]:
            found = "none" if now is None else f"{now['source']} (sha256 {now['sha256'][:12]})"
            raise RunError(
                f"this run trained with the {name} {was['source']} (sha256 "
                f"{was['sha256'][:12]}), but its config now gives {found}; restore those "
                "weights, or start a new run.dir."
            )


def modules(names_, graphdefs_, held, *, graphdef, params, frozen, model_state) -> dict:
    """name -> nnx.Module of each frozen model for one call of the objective: a held one from
    `held` (`TrainState.others`), held adapters on the policy's base (a value head's zeros
    beside them), the policy's base with its adapters zeroed otherwise."""
    out = {}
    for name in names_:
        if name in graphdefs_:
            w = held[name]
            out[name] = merge_model(graphdefs_[name], w["params"], None, w["model_state"])
        elif held and name in held:
            w = held[name]["params"]
            start = {
                k: w[k] if k in w else jax.tree.map(jnp.zeros_like, v) for k, v in params.items()
            }
            out[name] = merge_model(graphdef, start, frozen, model_state)
        else:
            off = jax.tree.map(jnp.zeros_like, params)  # constants: no gradient flows
            out[name] = merge_model(graphdef, off, frozen, model_state)
    return out


def attach(state, cfg: Config, mesh: Mesh, ckpt_dir, start: int):
    """(state with its `others` loaded, their records for the checkpoints): at a resume
    (`start` > 0) the checkpoint's records must match the sources the config gives now."""
    held = resolve_others(cfg, from_config(cfg))
    now = records(held)
    if start > 0:
        check(checkpoint.read_json_item(ckpt_dir, start, OTHERS_ITEM), now)
    return state.replace(others=load(held, mesh)), now
