"""Loss scaling for float16 compute (Micikevicius et al. 2018, "Mixed Precision Training").

float16 has 5 exponent bits: gradients of activations below ~6e-8 flush to zero in the backward
pass. The step multiplies the objective's loss by a scale S before differentiation, so every
backward intermediate is S times larger and stays representable, then divides the float32
gradients by S before clipping and the optimizer. The parameters never see S.

S is per token: the step multiplies the objective's loss *sum* by S / (token positions of a
microbatch), so S means what it means for a mean loss (PyTorch's GradScaler, jmp) whatever the
batch size. Scaling the sum by S would make the weight gradients, sums over every token of the
microbatch, B*L times larger, and the S that fits float16 would shrink as the batch grows.

`dynamic` scaling (the default for float16) finds S on its own, as PyTorch's GradScaler and
TensorFlow's LossScaleOptimizer do: a step whose gradients overflowed is skipped by the step's
non-finite guard and multiplies S by `backoff`; `growth_interval` clean steps in a row multiply
it by `growth`. S never goes below 1: a step that overflows at S = 1 overflows without scaling
too, so it is a real non-finite step, not an overflow. The dynamic state (S and the clean-step
count) is part of the train state, replicated, checkpointed and resumed. `static` scaling keeps
S at its initial value and needs no state.

(DeepMind's `jmp` has the same idea, but ties growth and backoff to one factor and has not been
released since 2023; these few pure functions are all the step needs.)
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig, OptimConfig


@flax.struct.dataclass
class LossScaleState:
    """The dynamic scale as it lives in `TrainState.loss_scale`."""

    scale: jax.Array  # float32 scalar: S, multiplies the loss before differentiation
    good_steps: jax.Array  # int32 scalar: clean steps since S last changed


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """How the step scales the loss; static (hashable), bound to the step before jit."""

    dynamic: bool
    init: float
    growth_interval: int
    growth: float
    backoff: float

    def initial(self) -> LossScaleState | None:
        """The train state's part: the dynamic scale at its start; None for a static one."""
        if not self.dynamic:
            return None
        return LossScaleState(
            scale=jnp.asarray(self.init, jnp.float32), good_steps=jnp.zeros((), jnp.int32)
        )

    def scale(self, state: LossScaleState | None) -> jax.Array:
        """S for this step."""
        return state.scale if self.dynamic else jnp.asarray(self.init, jnp.float32)

    def update(self, state: LossScaleState | None, finite: jax.Array) -> LossScaleState | None:
        """The state after a step that was clean (`finite`) or skipped by the guard."""
        if not self.dynamic:
            return None
        good = state.good_steps + 1
        grow = good >= self.growth_interval
        grown = state.scale * self.growth
        # Growth stops where S would leave float32 (a float16 backward has overflowed long before).
        grown = jnp.where(jnp.isfinite(grown), grown, state.scale)
        scale = jnp.where(
            finite,
            jnp.where(grow, grown, state.scale),
            jnp.maximum(state.scale * self.backoff, 1.0),
        )
        good_steps = jnp.where(finite & ~grow, good, 0).astype(jnp.int32)
        return LossScaleState(scale=scale.astype(jnp.float32), good_steps=good_steps)


def from_config(optim: OptimConfig, model: ModelConfig) -> LossScaling | None:
    """The run's loss scaling, or None when the loss is not scaled (`optim.loss_scale` resolved
    against the compute dtype `model.dtype`)."""
    mode = optim.resolved_loss_scale(model.dtype)
    if mode == "none":
        return None
    return LossScaling(
        dynamic=mode == "dynamic",
        init=optim.loss_scale_init,
        growth_interval=optim.loss_scale_growth_interval,
        growth=optim.loss_scale_growth,
        backoff=optim.loss_scale_backoff,
    )
