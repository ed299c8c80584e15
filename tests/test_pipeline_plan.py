"""`jaxllm plan` on pipelined configs: the schedule's bubble and in-flight microbatches, and
XLA's memory analysis showing GPipe holding m stage inputs where 1F1B holds p."""

import jax
import pytest
from conftest import tiny_model

from jaxllm import config
from jaxllm.plan import format_plan, plan


def _cfg(schedule: str, m: int) -> config.Config:
    return config.Config(
        model=tiny_model(vocab_size=264, num_layers=4, d_model=64, mlp_dim=128),
        mesh=config.MeshConfig(stage=2, data=4, pipeline_schedule=schedule),
        data=config.DataConfig(seq_len=64),
        train=config.TrainConfig(global_batch_size=4 * m, grad_accum_steps=m),
    )


@pytest.mark.slow  # two plan compiles, ~25 s on an idle 2-core machine
def test_plan_reports_the_bubble_and_gpipe_holds_more_inputs_than_1f1b():
    m = 8
    gpipe, one_f = (plan(_cfg(s, m), jax.devices()) for s in ("gpipe", "1f1b"))
    assert gpipe["pipeline"]["in_flight"] == (m, m)
    assert one_f["pipeline"]["in_flight"] == (2, 2)
    assert one_f["pipeline"]["bubble_ratio"] == pytest.approx(1 / m)
    # one stage input: a microbatch of 4 rows / 4 data shards x 64 positions x 64 float32
    act = 1 * 64 * 64 * 4
    extra = gpipe["memory"]["temporaries"] - one_f["memory"]["temporaries"]
    assert extra >= (m - 2) * act
    assert "in-flight microbatches per stage [8, 8]" in format_plan(gpipe)
