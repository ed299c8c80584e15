"""`jaxllm sweep`: a grid of overrides trained run by run, compared in a table and a plot."""

import csv
import math

import pytest

from jaxllm import cli
from jaxllm.config import ConfigError
from jaxllm.sweep import combinations, parse_grid, run_name, sweep

FAST = [
    "model.d_model=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.mlp_dim=64",
    "data.seq_len=32",
    "data.max_files=20",
    "train.steps=5",
    "train.global_batch_size=8",
    "train.eval_batches=1",
    "train.eval_every=0",
    "train.log_every=1",
    "train.sample_tokens=0",
    "checkpoint.save_final=false",
]


@pytest.mark.slow  # ~27 s; the grid, its naming and its report run by default with a stand-in train
def test_sweep_cli_trains_a_2x1_grid_and_writes_table_csv_and_plot(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = cli.main(
        [
            "sweep",
            *FAST,
            "--grid",
            "model.position=rope,alibi",
            "--grid",
            "model.norm_placement=pre",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "| position=rope,norm_placement=pre |" in table
    assert "| position=alibi,norm_placement=pre |" in table
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == [
        "position=rope,norm_placement=pre",
        "position=alibi,norm_placement=pre",
    ]
    for r in rows:
        assert r["status"] == "ok" and r["steps"] == "5"
        assert 0 < float(r["eval_loss"]) < math.log(258) + 1 and float(r["tokens_per_s"]) > 0
        assert int(r["params"]) > 0
        assert (out / r["run"] / "metrics.jsonl").is_file()
    assert rows[0]["eval_loss"] != rows[1]["eval_loss"]  # the knob changed the model
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "**" in (out / "results.md").read_text()  # the best run is marked


def test_grid_parsing_and_naming():
    grid = parse_grid(["model.position=rope,alibi", "model.norm=rmsnorm,layernorm"])
    combos = combinations(grid)
    assert len(combos) == 4 and combos[1] == ["model.position=rope", "model.norm=layernorm"]
    assert run_name(combos[1]) == "position=rope,norm=layernorm"
    tied = combinations(parse_grid(["model.mlp_activation+model.mlp_dim=swiglu+320,gelu+480"]))
    assert tied == [
        ["model.mlp_activation=swiglu", "model.mlp_dim=320"],
        ["model.mlp_activation=gelu", "model.mlp_dim=480"],
    ]
    assert run_name(tied[1]) == "mlp_activation=gelu,mlp_dim=480"
    for bad in (["model.position"], ["model.position="], ["a=1", "a=2"], ["a+b=1+2,3"], ["a+b=1"]):
        with pytest.raises(ConfigError):
            parse_grid(bad)


def test_a_rejected_combination_is_reported_and_the_others_run(tmp_path):
    trained = []

    def fake_train(cfg):
        trained.append(cfg.model.position)
        return {}

    results = sweep(
        None,
        ["model.attention_impl=flash"],
        ["model.position=rope,alibi"],
        tmp_path,
        train_fn=fake_train,
    )
    assert trained == ["rope"]
    assert results[0].status == "no metrics"  # the fake run wrote none
    assert results[1].status.startswith("config error") and "alibi" in results[1].status
    assert "config error" in (tmp_path / "results.md").read_text()
