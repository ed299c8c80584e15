"""Train state, the pure train / eval steps, and the host loop."""

from jaxllm.train.state import TrainState, init_state, state_shardings
from jaxllm.train.step import eval_step, loss_fn, train_step

__all__ = [
    "TrainState",
    "eval_step",
    "init_state",
    "loss_fn",
    "state_shardings",
    "train_step",
]
