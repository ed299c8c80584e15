"""Checks of context parallelism (`mesh.sequence_attention` over `mesh.sequence`) against the
model and the data: what ring attention (and USP's ring) supports, and the degrees Ulysses
can split."""

from __future__ import annotations

from jaxllm.config.errors import fail as _fail


def validate_sequence(cfg, degrees: dict[str, int] | None) -> None:
    """ConfigError naming the keys when `mesh.sequence_attention` cannot run this config;
    `degrees`: the mesh's degrees (None before the device count is known)."""
    m, mode, u = cfg.model, cfg.mesh.sequence_attention, cfg.mesh.sequence_ulysses
    if u < 1 or (u != 1 and mode != "usp"):
        _fail(
            f"mesh.sequence_ulysses ({u}) is the Ulysses degree of mesh.sequence_attention=usp: "
            "set it >= 1 with usp, or leave it at 1."
        )
    if mode in ("ring", "usp") and (
        m.position == "alibi"
        or m.sliding_window is not None
        or m.attn_soft_cap is not None
        or m.attn_scale is not None
        or m.attention_sinks
    ):
        _fail(
            f"mesh.sequence_attention={mode} supports neither model.position=alibi, "
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
    if mode != "usp":
        return
    if seq % u:
        _fail(f"mesh.sequence_ulysses ({u}) must divide mesh.sequence ({seq}).")
    if m.num_heads % (tensor * u):
        _fail(
            f"mesh.sequence_attention=usp splits model.num_heads ({m.num_heads}) over "
            f"mesh.tensor * mesh.sequence_ulysses ({tensor} * {u} = {tensor * u}), which does "
            "not divide it; change the degrees."
        )
    if cfg.data.seq_len % (2 * seq // u):
        _fail(
            f"data.seq_len ({cfg.data.seq_len}) must be divisible by 2 * mesh.sequence / "
            f"mesh.sequence_ulysses ({2 * seq // u}) for the zigzag layout of USP's ring."
        )


def validate_tensor_sequence(cfg, degrees: dict[str, int]) -> None:
    """mesh.tensor_sequence_parallel: a tensor group to split over and a length it divides."""
    t, s = degrees["tensor"], degrees["sequence"]
    if t == 1:
        _fail(
            "mesh.tensor_sequence_parallel splits the residual stream over mesh.tensor, "
            "which is 1; set mesh.tensor > 1 or leave it false."
        )
    if cfg.model.kind == "encoder_decoder":
        _fail(
            "mesh.tensor_sequence_parallel covers decoder and encoder stacks, not kind=encoder_decoder."
        )
    if cfg.data.seq_len % (t * s):
        _fail(
            f"data.seq_len ({cfg.data.seq_len}) must be divisible by mesh.tensor x "
            f"mesh.sequence ({t * s}) for mesh.tensor_sequence_parallel."
        )
