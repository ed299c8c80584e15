"""The engine: train state, the pure train / eval steps, the host loop, and the frozen
companion models beside the trained one. What the step minimises is plugged in from
`jaxllm.objectives`."""

from jaxllm.train.state import TrainState, init_state, state_shardings
from jaxllm.train.step import eval_step, objective_value, train_step

__all__ = [
    "TrainState",
    "eval_step",
    "init_state",
    "objective_value",
    "state_shardings",
    "train_step",
]
