"""Checks of `train.grad_compression` and its keys against the rest of the config."""

from __future__ import annotations

import dataclasses

from jaxllm.config.errors import fail as _fail
from jaxllm.config.train import ROLLOUT_OBJECTIVES

# The mesh axes other than `data` a compressed exchange cannot run with (the model is whole on
# every data replica; each replica's gradient is compressed as one piece).
_OTHER_AXES = ("stage", "fsdp", "tensor", "tensor2", "sequence", "expert")


def validate_grad_compression(cfg) -> None:
    """ConfigError naming the key when the compression settings do nothing or cannot run."""
    t, mesh = cfg.train, cfg.mesh
    method = t.grad_compression
    if method not in ("topk", "dgc", "tagc") and t.grad_compression_ratio != 0.01:
        _fail("train.grad_compression_ratio needs train.grad_compression=topk, dgc or tagc.")
    if method != "dgc" and t.grad_compression_warmup:
        _fail("train.grad_compression_warmup needs train.grad_compression=dgc.")
    if t.grad_compression_warmup < 0:
        _fail(f"train.grad_compression_warmup must be >= 0, not {t.grad_compression_warmup}.")
    o = cfg.optim
    if method == "dgc" and (o.name != "sgd" or not o.momentum > 0 or o.nesterov):
        _fail(
            "train.grad_compression=dgc corrects momentum SGD's momentum on each replica: it "
            "needs optim.name=sgd with optim.momentum > 0 and optim.nesterov=false, not "
            f"optim.name={o.name} momentum={o.momentum} nesterov={str(o.nesterov).lower()}."
        )
    if method != "qsgd" and t.grad_compression_bits != 8:
        _fail("train.grad_compression_bits needs train.grad_compression=qsgd.")
    if not 0 < t.grad_compression_ratio <= 1:
        _fail(f"train.grad_compression_ratio must be in (0, 1], not {t.grad_compression_ratio}.")
    if not 2 <= t.grad_compression_bits <= 16:
        _fail(f"train.grad_compression_bits must be in 2..16, not {t.grad_compression_bits}.")
    if method == "none":
        return
    layout = [f"mesh.{a}" for a in _OTHER_AXES if getattr(mesh, a) != 1]
    layout += [f"mesh.dcn_{a}" for a in _OTHER_AXES if getattr(mesh, f"dcn_{a}", 1) != 1]
    if layout:
        _fail(
            f"train.grad_compression={method} compresses the data-parallel exchange of whole "
            f"replicas; it cannot run with {', '.join(layout)} != 1. Set them to 1 or "
            "train.grad_compression=none."
        )
    if mesh.zero_stage:
        _fail(
            f"train.grad_compression={method} needs whole gradients on every replica; "
            f"mesh.zero_stage={mesh.zero_stage} splits them. Set mesh.zero_stage=0."
        )
    if cfg.optim.offload != "none":
        _fail(f"train.grad_compression={method} does not run with optim.offload yet.")
    if t.qat.enabled or cfg.peft.method != "none" or t.objective in ROLLOUT_OBJECTIVES:
        _fail(
            f"train.grad_compression={method} trains full models by the standard step; it "
            "does not run with train.qat, peft or the rollout objectives yet."
        )


def step_optim(cfg):
    """The `optim` section the optimizer is built from: under `dgc` the momentum and the
    clipping move into the replicas' exchange, so the optimizer is plain SGD without them."""
    if cfg.train.grad_compression != "dgc":
        return cfg.optim
    return dataclasses.replace(cfg.optim, momentum=0.0, clip_norm=None)
