"""Checks of context parallelism (`mesh.sequence_attention` over `mesh.sequence`) against the
model and the data: what ring attention supports, and the degrees Ulysses can split."""

from __future__ import annotations

from jaxllm.config.errors import fail as _fail


def validate_sequence(cfg, degrees: dict[str, int] | None) -> None:
    """ConfigError naming the keys when `mesh.sequence_attention` cannot run this config;
    `degrees`: the mesh's degrees (None before the device count is known)."""
    m, mode = cfg.model, cfg.mesh.sequence_attention
    if mode == "ring" and (
        m.position == "alibi"
        or m.sliding_window is not None
        or m.attn_soft_cap is not None
        or m.attn_scale is not None
        or m.attention_sinks
    ):
        _fail(
            "mesh.sequence_attention=ring supports neither model.position=alibi, "
            "model.sliding_window, model.attn_soft_cap, model.attn_scale nor "
            "model.attention_sinks; use all_gather or ulysses."
        )
    if degrees is None:
        return
    seq, tensor = degrees["sequence"], degrees["tensor"]
    if mode == "ring" and cfg.data.seq_len % (2 * seq):
        _fail(
            f"data.seq_len ({cfg.data.seq_len}) must be divisible by 2 * mesh.sequence "
            f"({2 * seq}) for ring attention's zigzag layout."
        )
    if mode == "ulysses" and m.num_heads % (tensor * seq):
        _fail(
            f"mesh.sequence_attention=ulysses splits model.num_heads ({m.num_heads}) over "
            f"mesh.tensor * mesh.sequence ({tensor} * {seq} = {tensor * seq}), which does not "
            "divide it; change the degrees or use ring / all_gather."
        )
