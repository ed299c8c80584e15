"""Train state, the pure train / eval steps, and the host loop."""

from jaxllm.train.objectives import Objective, ObjectiveOutput, next_token
from jaxllm.train.state import TrainState, init_state, state_shardings
from jaxllm.train.step import eval_step, objective_value, train_step

__all__ = [
    "TrainState",
    "eval_step",
    "init_state",
    "Objective",
    "ObjectiveOutput",
    "next_token",
    "objective_value",
    "state_shardings",
    "train_step",
]
