"""Hugging Face checkpoints in and out: Llama (2, 3, 3.1/3.2 RoPE scaling), Mistral, Mixtral,
Qwen2, Qwen3, Gemma 2, DeepSeek-V3 and GPT-2, as safetensors + config.json.

    jaxllm convert import HF_DIR OUT_DIR [key=value ...]     # a run directory
    jaxllm convert export RUN_DIR|CHECKPOINT HF_DIR [--family NAME]

`families.py` holds the per-family config and tensor-name mappings, `hf.py` the streaming
import (every parameter created in its shards on the mesh) and the export, `cli.py` the
command. `jaxllm.load_model(HF_DIR)` loads a Hugging Face directory directly and
`checkpoint.init_from=...` starts training from one.
"""

from __future__ import annotations

from pathlib import Path

from jaxllm.config import ConfigError, ModelConfig
from jaxllm.convert.families import FAMILIES
from jaxllm.convert.hf import export_hf, import_hf, is_hf_dir, load_params, model_config


def load_hf_model(hf_dir, *, mesh=None, overrides=()):
    """An `nnx.Module` with the parameters of a Hugging Face directory, streamed onto `mesh`
    (default: all devices, replicated)."""
    from flax import nnx

    from jaxllm import sharding
    from jaxllm.model import abstract_model

    cfg = model_config(hf_dir, overrides)
    mesh = mesh or sharding.make_mesh(cfg.mesh)
    graphdef, _, _ = abstract_model(cfg.model)
    params, model_state, _ = load_params(hf_dir, cfg.model, mesh)
    return nnx.merge(graphdef, params, model_state)


def load_params_from(source, model_cfg: ModelConfig, mesh) -> tuple[dict, dict | None]:
    """(parameters, model state) for `model_cfg` from a Hugging Face directory or a jaxllm run
    directory / checkpoint (`checkpoint.init_from`), in their shards on `mesh`. The source
    must describe the same parameter shapes; ConfigError names the first that differs. The
    model state (MoE routing biases) is None when the source has none of this model's shapes
    (the train state then starts it at zero)."""
    import jax

    from jaxllm import checkpoint, config, sharding
    from jaxllm.evaluate import resolve
    from jaxllm.model import abstract_model, abstract_model_state

    hf = _is_hf_source(source)
    if hf:
        theirs = model_config(source).model
    else:
        if not Path(source).exists():
            raise ConfigError(f"checkpoint.init_from={source} does not exist.")
        run_dir, ckpt_dir, step = resolve(source)
        theirs = config.load(run_dir / "config.yaml").model
    _, want, axes = abstract_model(model_cfg)
    _, have, _ = abstract_model(theirs)
    want_flat, have_flat = _shapes(want), _shapes(have)
    if want_flat != have_flat:
        diff = sorted(set(want_flat.items()) ^ set(have_flat.items()))[0][0]
        raise ConfigError(
            f"checkpoint.init_from={source} has other parameters than this model (first: "
            f"{diff}: {have_flat.get(diff)} there, {want_flat.get(diff)} here); make the model "
            "section match it (e.g. start from its config.yaml)."
        )
    if hf:
        params, model_state, _ = load_params(source, model_cfg, mesh)
        return params, model_state
    ckpt_dir = ckpt_dir or checkpoint.checkpoint_dir(run_dir, config.load(run_dir / "config.yaml")
                                                     .checkpoint.dir)  # fmt: skip

    def target(abstract, axes):
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
            sharding.tree_shardings(mesh, axes),
        )  # fmt: skip

    want_ms, ms_axes = abstract_model_state(model_cfg)
    same_state = bool(want_ms) and _shapes(want_ms) == _shapes(abstract_model_state(theirs)[0])
    if not same_state:
        return checkpoint.restore_weights(ckpt_dir, target(want, axes), step=step).params, None
    w = checkpoint.restore_weights(ckpt_dir, target(want, axes), target(want_ms, ms_axes), step)
    return w.params, w.model_state


def _is_hf_source(source) -> bool:
    """A Hugging Face directory, even a broken one (its config.json and no run config.yaml, as
    `jaxllm.load_model` decides), so that what is wrong with it is named rather than "not a run
    directory"."""
    path = Path(source)
    return is_hf_dir(path) or ((path / "config.json").is_file()
                               and not (path / "config.yaml").is_file())  # fmt: skip


def _shapes(tree, prefix="") -> dict[str, tuple]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_shapes(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = tuple(v.shape)
    return out


__all__ = [
    "FAMILIES",
    "export_hf",
    "import_hf",
    "is_hf_dir",
    "load_hf_model",
    "load_params",
    "load_params_from",
    "model_config",
]
