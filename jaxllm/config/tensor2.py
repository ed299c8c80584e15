"""Checks of 2D tensor parallelism (`mesh.tensor2`): the model dims it splits must divide, and
the layouts it does not cover are refused, one line each."""

from __future__ import annotations

from jaxllm.config.errors import fail as _fail


def validate_tensor2(cfg, degrees: dict[str, int]) -> None:
    """ConfigError naming the key when mesh.tensor2 > 1 cannot split this model on this mesh."""
    t2, t = degrees["tensor2"], degrees["tensor"]
    if t2 == 1:
        return
    m, mesh = cfg.model, cfg.mesh
    refused = [
        ("mesh.stage > 1", degrees["stage"] > 1),
        ("mesh.sequence > 1", degrees["sequence"] > 1),
        ("mesh.tensor_sequence_parallel", mesh.tensor_sequence_parallel),
        ("MLA (model.mla)", m.mla.enabled),
        ("MoE layers (model.moe)", m.moe.enabled),
        ("linear attention (model.layer_pattern)", m.linear_attention.enabled),
        ("model.kind=encoder_decoder", m.kind == "encoder_decoder"),
    ]
    for what, hit in refused:
        if hit:
            _fail(
                f"mesh.tensor2 ({t2}) splits dense attention and MLP weights over two axes and "
                f"does not run with {what}; set mesh.tensor2=1 or change that."
            )
    split = t2 * degrees["fsdp"]
    if m.d_model % split:
        _fail(
            f"model.d_model ({m.d_model}) must be divisible by mesh.tensor2 x mesh.fsdp "
            f"({t2} x {degrees['fsdp']} = {split}), which split the model dim."
        )
    if m.mlp_dim % t:
        _fail(f"mesh.tensor ({t}) must divide model.mlp_dim ({m.mlp_dim}) with mesh.tensor2.")
