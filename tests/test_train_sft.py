"""`jaxllm train train.objective=sft` on a chat JSONL: the tiny model trains through the command
line, and every step's loss counts exactly the assistant tokens of its batch."""

import json
import math

import pytest
from conftest import SMALL_RUN

from jaxllm import config, objectives
from jaxllm.cli import main

REPLY = 1 + len("<|im_end|>")  # every reply is one digit and its end-of-turn marker, in bytes


def test_sft_objective_is_built_in_and_keeps_z_loss():
    cfg = config.load(None, ["train.objective=sft", "train.z_loss=1e-4"])
    assert callable(objectives.from_config(cfg))
    assert "sft" in objectives.BUILT_IN


@pytest.mark.slow  # chat sources train in test_chat.py's and test_prompt_tuning.py's runs
def test_jaxllm_train_sft_on_a_chat_jsonl(tmp_path):
    # "<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n": 65 bytes, one
    # row of SMALL_RUN's data.seq_len=64 (whose compiled steps the suite shares)
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"{i % 5}+{i % 5}"},
                {"role": "assistant", "content": f"{2 * (i % 5)}"},
            ]
        }
        for i in range(24)
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    run = tmp_path / "run"
    source = f"[{{path: {data}, format: chat}}]"
    overrides = [f"data.sources={source}", f"data.eval_sources={source}", "train.objective=sft"]
    overrides += ["train.steps=3", "checkpoint.save_final=false", f"run.dir={run}"]
    assert main(["train", *SMALL_RUN, *overrides]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["loss"])
        assert r["tokens"] == pytest.approx(8 * REPLY)  # a step trains its 8 replies, nothing else
    assert math.isfinite(rows[-1]["eval_loss"])
    assert config.load(run / "config.yaml").train.objective == "sft"
