"""jaxllm: train LLMs in JAX, from a laptop CPU to a sharded pod, with one codebase."""

from __future__ import annotations

from jaxllm.config.errors import JaxllmWarning  # defined at the bottom floor, named here

__version__ = "0.1.0"


def load_model(path, *, mesh=None, overrides=()):
    """A trained model from a run directory (or its checkpoint directory), or a Hugging Face
    model directory (config.json + safetensors; `overrides` like `model.dtype=float32` apply).

    The newest readable checkpoint is used: a damaged newer one is reported with a
    JaxllmWarning and skipped. Returns an `nnx.Module` mapping int tokens [batch, length] to
    float32 logits [batch, length, vocab]. Parameters are restored straight into their shards on `mesh`
    (default: all devices, data-parallel, i.e. replicated).
    """
    from pathlib import Path

    import jax
    from flax import nnx

    from jaxllm import checkpoint, config, sharding
    from jaxllm.model import abstract_model, abstract_model_state

    path = Path(path)
    if not (path / "config.yaml").is_file() and (path / "config.json").is_file():
        from jaxllm.convert import load_hf_model

        return load_hf_model(path, mesh=mesh, overrides=overrides)
    run_dir = path if (path / "config.yaml").is_file() else path.parent
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(
            f"{path} is neither a run directory, its checkpoints directory, nor a Hugging Face "
            "model directory"
        )
    cfg = config.load(run_dir / "config.yaml", list(overrides))
    ckpt_dir = path if run_dir != path else checkpoint.checkpoint_dir(run_dir, cfg.checkpoint.dir)
    if mesh is None:
        mesh = sharding.make_mesh(config.MeshConfig())
    graphdef, abstract, axes = abstract_model(cfg.model)
    abstract_ms, ms_axes = abstract_model_state(cfg.model)

    def target(tree, axes):
        shardings = sharding.tree_shardings(mesh, axes)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
        )

    params, model_state, _ = checkpoint.restore_weights(
        ckpt_dir, target(abstract, axes), target(abstract_ms, ms_axes)
    )
    return nnx.merge(graphdef, params, model_state)


__all__ = ["JaxllmWarning", "__version__", "load_model"]
