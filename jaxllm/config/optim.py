"""`optim`: the optimizer, its schedule and its knobs, with the checks of their values."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

from jaxllm.config.errors import fail as _fail


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """One entry of `optim.param_groups`: the parameters whose path (`/`-joined, as `jaxllm
    plan` lists them, e.g. `visual/merger/fc1`) `re.search`es `match` step at
    `lr_scale` times the learning rate (0: frozen, no optimizer state) and, if set, with
    `weight_decay` instead of optim.weight_decay."""

    match: str = ""
    lr_scale: float = 1.0
    weight_decay: float | None = None


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """An optimizer (`name`) with a schedule, global-norm clipping and decoupled weight decay on
    kernels/embeddings. Keys an optimizer does not read must stay at their defaults
    (`OPTIM_READS`; anything else is a config error naming the key)."""

    name: Literal[
        "sgd",
        "adagrad",
        "rmsprop",
        "adam",
        "adamw",
        "adafactor",
        "lion",
        "lamb",
        "sm3",
        "muon",
        "adam_mini",
        "adamw_8bit",
        "soap",
        "shampoo",
        "came",
        "ldadam",
        "galore",
        "q_galore",
    ] = "adamw"
    """The optimizer (README lists what each keeps per parameter); `adam` is `adamw` without
    weight decay."""
    lr: float = 3e-3
    """Peak learning rate."""
    schedule: Literal["cosine", "linear", "constant", "step", "exponential", "cosine_restarts"] = (
        "cosine"
    )
    """Shape after warmup: cosine or linear decay to min_lr_ratio * lr, constant, `step` (x
    decay_rate every decay_every steps), `exponential` (the same, smoothly), each floored at
    min_lr_ratio * lr, or `cosine_restarts` (SGDR: cosine cycles of restart_steps, each
    restart_mult times the last)."""
    warmup_steps: int = 15
    """Linear warmup from 0 to lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (cosine, linear, cosine_restarts: each cycle's
    end), the floor of step and exponential."""
    b1: float = 0.9
    """Adam decay rate of the first moment."""
    b2: float = 0.95
    """Adam decay rate of the second moment."""
    eps: float = 1e-8
    """Adam epsilon added to the root of the second moment."""
    weight_decay: float = 0.1
    """Decoupled weight decay; never applied to norm scales or biases."""
    clip_norm: float | None = 1.0
    """Clip gradients to this global L2 norm; null disables clipping."""
    momentum: float = 0.0
    """Heavy-ball momentum of sgd and rmsprop (0: none)."""
    nesterov: bool = False
    """Nesterov momentum (sgd, rmsprop; needs momentum > 0)."""
    amsgrad: bool = False
    """adam/adamw: normalise by the running maximum of the second moment (Reddi et al. 2018)."""
    block_size: Literal[256, 2048] = 2048
    """adamw_8bit: elements per quantization block (one float32 absmax scale per block)."""
    quantization: Literal["dynamic", "linear"] = "dynamic"
    """adamw_8bit code book: bitsandbytes' dynamic tree (fine near 0) or 256 even steps."""
    precondition_every: int = 10
    """soap, shampoo: steps between recomputing the preconditioners (SOAP's eigenbasis,
    Shampoo's inverse roots) from their statistics."""
    came_b3: float = 0.9999
    """came: decay rate of the instability (confidence) factors."""
    galore_rank: int = 128
    """galore, q_galore, ldadam: rank r of each matrix's gradient projection."""
    galore_update_gap: int = 200
    """galore, q_galore: steps between refreshes of the projection (T)."""
    galore_scale: float = 0.25
    """galore, q_galore: factor on the projected-back update of each matrix (alpha)."""
    master_weights: Literal["none", "float32"] = "none"
    """`float32`: the optimizer steps a float32 master copy of the parameters, kept in its state,
    and the stored parameters are the master rounded to `model.param_dtype` (set that to
    bfloat16 or float16 for the classic 2 + 2 + 4 + 8 bytes per parameter of mixed-precision
    Adam). `none`: the optimizer steps the stored parameters."""
    offload: Literal["none", "host"] = "none"
    """`host` keeps the optimizer state (with the master weights, if any) in host memory
    (`pinned_host`) between steps: the step
    copies it to the device for the update and back, so the device holds it only while the
    update runs. Device memory saved for host bandwidth; see README "Memory"."""
    loss_scale: Literal["auto", "dynamic", "static", "none"] = "auto"
    """Multiply the loss (per token: the objective's sum over the token positions of a
    microbatch) by a scale S before differentiation and divide the float32 gradients by S
    before clipping, so small float16 gradients do not flush to zero (see
    `jaxllm.train.loss_scale`). `dynamic` adapts S: a step whose gradients overflow is skipped
    and backs S off, `loss_scale_growth_interval` clean steps grow it; `static` keeps S at
    `loss_scale_init`; `none` does not scale. `auto`: dynamic when model.dtype is float16,
    none for bfloat16 and float32 (their exponent range is float32's, nothing underflows)."""
    loss_scale_init: float = 2.0**15
    """S at the start (dynamic) or always (static); powers of two keep the unscaling exact."""
    loss_scale_growth_interval: int = 2000
    """Dynamic: grow S after this many clean steps in a row."""
    loss_scale_growth: float = 2.0
    """Dynamic: factor S grows by after `loss_scale_growth_interval` clean steps."""
    loss_scale_backoff: float = 0.5
    """Dynamic: factor S shrinks by after a step whose gradients were not finite (never below
    1)."""
    # schedules, stability knobs and batch-size scaling of the learning rate
    decay_every: int | None = None
    """step / exponential: steps (after warmup) per decay_rate factor."""
    decay_rate: float = 0.5
    """step / exponential: the factor, in (0, 1), per decay_every steps."""
    restart_steps: int | None = None
    """cosine_restarts: the first cycle's length in steps (after warmup)."""
    restart_mult: float = 1.0
    """cosine_restarts: each cycle is this many times longer than the last (>= 1)."""
    clip_value: float | None = None
    """Clip each gradient element to [-clip_value, clip_value] (before clip_norm); null: off."""
    grad_noise: float = 0.0
    """Add Gaussian noise of variance grad_noise / (1 + step)^grad_noise_gamma to the clipped
    gradients (Neelakantan et al. 2015, their eta); 0: off. Drawn from run.seed."""
    grad_noise_gamma: float = 0.55
    """The noise's annealing exponent (the paper's 0.55)."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale lr (and so the whole schedule) by train.global_batch_size / reference_batch_size
    (linear, Goyal et al. 2017) or its square root (sqrt, Krizhevsky 2014); printed at start."""
    reference_batch_size: int | None = None
    """lr_scaling: the global batch size at which lr is the given one."""
    # per-parameter-group learning rates and weight decay
    param_groups: tuple[ParamGroup, ...] = ()
    """Groups of parameters with their own lr factor / weight decay (`ParamGroup`); each
    parameter takes the first group whose `match` it fits, the others the optimizer's own."""

    def resolved_loss_scale(self, dtype: str) -> str:
        """`loss_scale` with `auto` resolved for the compute dtype `dtype` (model.dtype)."""
        if self.loss_scale != "auto":
            return self.loss_scale
        return "dynamic" if dtype == "float16" else "none"


# The OptimConfig keys (besides lr, schedule, warmup, min_lr_ratio, clip_norm) each optimizer
# reads. A key set away from its default for an optimizer that ignores it is a config error.
OPTIM_READS: dict[str, frozenset[str]] = {
    "sgd": frozenset({"momentum", "nesterov", "weight_decay"}),
    "adagrad": frozenset({"eps", "weight_decay"}),
    "rmsprop": frozenset({"b2", "eps", "momentum", "nesterov", "weight_decay"}),
    "adam": frozenset({"b1", "b2", "eps", "amsgrad"}),
    "adamw": frozenset({"b1", "b2", "eps", "amsgrad", "weight_decay"}),
    "adafactor": frozenset({"weight_decay"}),
    "lion": frozenset({"b1", "b2", "weight_decay"}),
    "lamb": frozenset({"b1", "b2", "eps", "weight_decay"}),
    "sm3": frozenset({"b1", "eps", "weight_decay"}),
    "muon": frozenset({"b1", "b2", "eps", "weight_decay"}),
    "adam_mini": frozenset({"b1", "b2", "eps", "weight_decay"}),
    "adamw_8bit": frozenset({"b1", "b2", "eps", "weight_decay", "block_size", "quantization"}),
    "soap": frozenset({"b1", "b2", "eps", "weight_decay", "precondition_every"}),
    "shampoo": frozenset({"b1", "b2", "eps", "weight_decay", "precondition_every"}),
    "came": frozenset({"b1", "b2", "came_b3", "weight_decay"}),
    "ldadam": frozenset({"b1", "b2", "eps", "galore_rank", "weight_decay"}),
    "galore": frozenset(
        {"b1", "b2", "eps", "galore_rank", "galore_update_gap", "galore_scale", "weight_decay"}
    ),
    "q_galore": frozenset(
        {"b1", "b2", "eps", "galore_rank", "galore_update_gap", "galore_scale", "weight_decay"}
    ),
}
OPTIM_SPECIFIC = frozenset().union(*OPTIM_READS.values())


def validate_optim(o: OptimConfig, param_dtype: str, z_loss: float) -> None:
    """Values no type can refuse: NaN or negative rates, betas outside [0, 1), keys the chosen
    optimizer does not read, master weights of the parameters' own dtype."""
    finite = {
        "optim.lr": o.lr,
        "optim.eps": o.eps,
        "optim.weight_decay": o.weight_decay,
        "optim.min_lr_ratio": o.min_lr_ratio,
        "train.z_loss": z_loss,
    }
    if o.clip_norm is not None:
        finite["optim.clip_norm"] = o.clip_norm
    for key, value in finite.items():
        if not math.isfinite(value) or value < 0:
            _fail(f"{key} must be a finite number >= 0, not {value}.")
    if o.eps <= 0 or (o.clip_norm is not None and o.clip_norm <= 0):
        _fail("optim.eps and optim.clip_norm must be > 0 (clip_norm: null turns clipping off).")
    for key, value in (("optim.b1", o.b1), ("optim.b2", o.b2), ("optim.came_b3", o.came_b3)):
        if not 0 <= value < 1:
            _fail(f"{key} must be in [0, 1), not {value}.")
    if o.galore_rank < 1 or o.galore_update_gap < 1:
        _fail(
            "optim.galore_rank and optim.galore_update_gap must be >= 1, not "
            f"{o.galore_rank} and {o.galore_update_gap}."
        )
    if not math.isfinite(o.galore_scale) or o.galore_scale <= 0:
        _fail(f"optim.galore_scale must be a finite number > 0, not {o.galore_scale}.")
    if o.min_lr_ratio > 1:
        _fail(f"optim.min_lr_ratio must be in [0, 1], not {o.min_lr_ratio}.")
    default = OptimConfig()
    for key in sorted(OPTIM_SPECIFIC - OPTIM_READS[o.name]):
        if getattr(o, key) != getattr(default, key):
            readers = sorted(n for n, keys in OPTIM_READS.items() if key in keys)
            _fail(
                f"optim.{key} does nothing with optim.name={o.name}; leave it at "
                f"{getattr(default, key)} or pick one of {', '.join(readers)}."
            )
    if not 0 <= o.momentum < 1:
        _fail(f"optim.momentum must be in [0, 1), not {o.momentum}.")
    if o.precondition_every < 1:
        _fail(f"optim.precondition_every must be >= 1, not {o.precondition_every}.")
    if o.nesterov and o.momentum == 0:
        _fail("optim.nesterov=true needs optim.momentum > 0 (e.g. optim.momentum=0.9).")
    if o.master_weights != "none" and param_dtype == o.master_weights:
        _fail(
            f"optim.master_weights={o.master_weights} copies parameters that are already "
            f"{o.master_weights}; set model.param_dtype=bfloat16 (or float16) with it, or "
            "drop it."
        )


def validate_param_groups(o: OptimConfig) -> None:
    """Each group's regex compiles, its factor and decay are finite and >= 0, and its decay is
    one the optimizer reads (see `jaxllm.optim.groups` for the optimizers that refuse)."""
    for i, g in enumerate(o.param_groups):
        key = f"optim.param_groups[{i}]"
        if not g.match:
            _fail(f"{key}.match is empty; give a regex of parameter paths, e.g. match: visual.")
        try:
            re.compile(g.match)
        except re.error as e:
            _fail(f"{key}.match {g.match!r} is not a regular expression ({e}).")
        if not (math.isfinite(g.lr_scale) and g.lr_scale >= 0):
            _fail(f"{key}.lr_scale must be a finite number >= 0 (0: frozen), not {g.lr_scale}.")
        if g.weight_decay is None:
            continue
        if g.lr_scale == 0:
            _fail(f"{key}.weight_decay does nothing with lr_scale 0 (frozen); drop it.")
        if not (math.isfinite(g.weight_decay) and g.weight_decay >= 0):
            _fail(f"{key}.weight_decay must be a finite number >= 0, not {g.weight_decay}.")
        if "weight_decay" not in OPTIM_READS[o.name] or o.name == "muon":
            _fail(
                f"{key}.weight_decay does nothing with optim.name={o.name} (no per-group decay "
                "there); drop it or use adamw."
            )


# The keys each schedule reads beside lr, warmup_steps and min_lr_ratio; set for another, refused.
SCHEDULE_READS: dict[str, frozenset[str]] = {
    "step": frozenset({"decay_every", "decay_rate"}),
    "exponential": frozenset({"decay_every", "decay_rate"}),
    "cosine_restarts": frozenset({"restart_steps", "restart_mult"}),
}
SCHEDULE_SPECIFIC = frozenset().union(*SCHEDULE_READS.values())


def resolved_lr(o: OptimConfig, global_batch: int) -> float:
    """The peak learning rate of a run whose steps take `global_batch` rows: `lr` scaled by
    `lr_scaling` from `reference_batch_size`."""
    if o.lr_scaling == "none":
        return o.lr
    ratio = global_batch / o.reference_batch_size
    return o.lr * (ratio if o.lr_scaling == "linear" else math.sqrt(ratio))


def validate_schedule(o: OptimConfig, train_steps: int) -> None:
    """The schedule's keys (only the chosen schedule's may leave their defaults, with values it
    can run), the stability knobs, and lr_scaling with its reference batch."""
    default = OptimConfig()
    for key in sorted(SCHEDULE_SPECIFIC - SCHEDULE_READS.get(o.schedule, frozenset())):
        if getattr(o, key) != getattr(default, key):
            readers = sorted(n for n, keys in SCHEDULE_READS.items() if key in keys)
            _fail(
                f"optim.{key} does nothing with optim.schedule={o.schedule}; leave it at "
                f"{getattr(default, key)} or pick optim.schedule={' or '.join(readers)}."
            )
    after = train_steps - min(o.warmup_steps, max(train_steps - 1, 0))
    if o.schedule in ("step", "exponential"):
        if o.decay_every is None or o.decay_every < 1:
            _fail(
                f"optim.schedule={o.schedule} needs optim.decay_every >= 1 (steps per decay), "
                f"not {o.decay_every}."
            )
        if not 0 < o.decay_rate < 1:
            _fail(f"optim.decay_rate must be in (0, 1), not {o.decay_rate}.")
        if o.schedule == "step" and o.decay_every >= after:
            _fail(
                f"optim.decay_every={o.decay_every} never decays in the {after} steps after "
                "warmup (train.steps - optim.warmup_steps); make it smaller."
            )
    if o.schedule == "cosine_restarts":
        if o.restart_steps is None or o.restart_steps < 1:
            _fail(
                "optim.schedule=cosine_restarts needs optim.restart_steps >= 1 (the first "
                f"cycle's steps), not {o.restart_steps}."
            )
        if not (math.isfinite(o.restart_mult) and o.restart_mult >= 1):
            _fail(f"optim.restart_mult must be a finite number >= 1, not {o.restart_mult}.")
        if o.restart_steps >= after:
            _fail(
                f"optim.restart_steps={o.restart_steps} never restarts in the {after} steps "
                "after warmup; make it smaller or use optim.schedule=cosine."
            )
    if o.clip_value is not None and not (math.isfinite(o.clip_value) and o.clip_value > 0):
        _fail(f"optim.clip_value must be a finite number > 0 (null: off), not {o.clip_value}.")
    if not (math.isfinite(o.grad_noise) and o.grad_noise >= 0):
        _fail(f"optim.grad_noise must be a finite number >= 0 (0: off), not {o.grad_noise}.")
    if not (math.isfinite(o.grad_noise_gamma) and o.grad_noise_gamma >= 0):
        _fail(f"optim.grad_noise_gamma must be a finite number >= 0, not {o.grad_noise_gamma}.")
    if o.grad_noise == 0 and o.grad_noise_gamma != default.grad_noise_gamma:
        _fail("optim.grad_noise_gamma does nothing with optim.grad_noise=0; set optim.grad_noise.")
    if o.lr_scaling != "none" and o.reference_batch_size is None:
        _fail(
            f"optim.lr_scaling={o.lr_scaling} needs optim.reference_batch_size: the global batch "
            "size at which optim.lr is right."
        )
    if o.reference_batch_size is not None:
        if o.lr_scaling == "none":
            _fail(
                "optim.reference_batch_size does nothing with optim.lr_scaling=none; set "
                "optim.lr_scaling=linear or sqrt, or drop it."
            )
        if o.reference_batch_size < 1:
            _fail(f"optim.reference_batch_size must be >= 1, not {o.reference_batch_size}.")
