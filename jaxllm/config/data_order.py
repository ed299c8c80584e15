"""Checks of `data.order` (`jaxllm.data.pipeline` puts the training rows in that order)."""

from __future__ import annotations

from jaxllm.config.errors import fail
from jaxllm.config.train import ROLLOUT_OBJECTIVES


def validate_order(data, objective: str) -> None:
    """Refuses an order the run cannot honour: one that no training row would follow (a rollout
    objective samples its own batches), `length` over examples or pairs (it sorts text
    documents), and `curriculum` over one source or with weights (it takes sources whole)."""
    order = data.order
    if order == "shuffled":
        return
    if objective in ROLLOUT_OBJECTIVES:
        fail(
            f"data.order={order} orders training rows, but train.objective={objective} samples "
            "its own batches from prompts; leave data.order=shuffled."
        )
    if order == "length":
        for src in data.sources:
            if src.format in ("chat", "prompt_completion", "preference", "unpaired_preference"):
                fail(
                    f"data.order=length sorts text documents, but data source {src.path!r} has "
                    f"format {src.format}; use data.order=shuffled or curriculum."
                )
    if order == "curriculum":
        if len(data.sources) < 2:
            fail(
                "data.order=curriculum takes data.sources one after another and needs two or "
                f"more; this run lists {len(data.sources)}. Add a source or use data.order=length "
                "or shuffled."
            )
        for src in data.sources:
            if src.weight != 1.0:
                fail(
                    f"data.order=curriculum shows every row of each source once, so the weight "
                    f"{src.weight} of data source {src.path!r} would do nothing; remove it (or "
                    "use data.order=shuffled, which mixes by weight)."
                )
