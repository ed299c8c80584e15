"""Tests of jaxllm.config and the CLI's handling of config mistakes.

The dataclass defaults are the default run; overrides are type-checked; unknown keys get a
suggestion; includes compose; impossible combinations and mesh shapes raise ConfigError naming
the key; dump/load round-trips; and `jaxllm train` turns every such mistake into one line on
stderr and exit code 2, quickly and without a traceback.
"""

import dataclasses
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxllm import config, objectives
from jaxllm.config import Config, ConfigError, MeshConfig, ModelConfig, RopeConfig, TrainConfig

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RUN = REPO / "configs" / "runs" / "default.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    """Presets are looked up in ./configs; run every test from the repo root."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("JAXLLM_CONFIGS", raising=False)


def load_error(*overrides, path=None) -> str:
    with pytest.raises(ConfigError) as e:
        config.load(path, list(overrides))
    return str(e.value)


# ------------------------------------------------------------------------- defaults


def test_default_run_yaml_equals_dataclass_defaults():
    assert config.load(DEFAULT_RUN) == Config()
    assert config.load(None) == Config()


# ------------------------------------------------------------------------- overrides


def test_overrides_set_nested_values():
    cfg = config.load(DEFAULT_RUN, ["train.steps=20", "model.tie_embeddings=true"])
    assert cfg.train.steps == 20 and cfg.model.tie_embeddings is True
    assert dataclasses.replace(cfg.train, steps=150) == TrainConfig()  # nothing else changed


def test_int_field_rejects_text():
    msg = load_error("train.steps=abc")
    assert "train.steps" in msg and "integer" in msg


def test_float_field_accepts_int():
    cfg = config.load(None, ["optim.lr=1"])
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float


def test_bool_field_rejects_number():
    assert "checkpoint.save_final" in load_error("checkpoint.save_final=3")


def test_literal_field_lists_choices():
    msg = load_error("model.remat=bogus")
    assert "model.remat" in msg and "bogus" in msg
    for choice in ("none", "full", "dots", "dots_with_no_batch_dims"):
        assert choice in msg


def test_optional_field_accepts_null():
    cfg = config.load(None, ["model.head_dim=64", "model.head_dim=null"])
    assert cfg.model.head_dim is None and cfg.model.resolved_head_dim == 64
    assert config.load(None, ["optim.clip_norm=null"]).optim.clip_norm is None


def test_mesh_preset_shorthand_loads_preset_file():
    cfg = config.load(DEFAULT_RUN, ["mesh=fsdp"])
    assert cfg.mesh == MeshConfig(data=1, fsdp=-1)
    assert cfg.mesh != Config().mesh
    assert config.load(DEFAULT_RUN, ["mesh=fsdp", "mesh.tensor=2"]).mesh.tensor == 2


def test_unknown_preset_lists_available():
    msg = load_error("mesh=nope")
    assert "nope" in msg
    for name in ("dp", "fsdp", "single"):
        assert name in msg


# ------------------------------------------------------------------------- unknown keys


def test_unknown_key_suggests_close_match():
    msg = load_error("model.num_layer=3")
    assert "model.num_layer" in msg and "did you mean model.num_layers" in msg


def test_a_flow_mapping_without_a_space_after_the_colon_says_so():
    # YAML reads {path:x} as the one key "path:x" (with no value)
    msg = load_error("data.sources=[{path:corpus.jsonl}]")
    assert "YAML needs a space after the colon: write {path: corpus.jsonl}." in msg


def test_an_empty_string_override_says_how_to_write_it():
    # `train.sample_prompt=""` in a shell arrives as `train.sample_prompt=`: YAML null
    msg = load_error("train.sample_prompt=")
    assert "train.sample_prompt must be a string, not empty (null)" in msg
    assert "\"train.sample_prompt=''\"" in msg
    assert config.load(None, ["train.sample_prompt=''"]).train.sample_prompt == ""


def test_unknown_section_suggests_close_match():
    msg = load_error("modle.d_model=3")
    assert "modle" in msg and "did you mean model" in msg


def test_unknown_key_in_yaml_file(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  stepz: 3\n")
    msg = load_error(path=tmp_path / "c.yaml")
    assert "train.stepz" in msg and "train.steps" in msg


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(RopeConfig)])
def test_moved_rope_key_in_an_override_names_its_new_key(name):
    msg = load_error(f"model.rope_{name}=1")
    assert msg == f"model.rope_{name} is now model.rope.{name}; rename the key."


def test_moved_rope_key_in_yaml_names_its_new_key(tmp_path):
    """A config written before RoPE became its own section (a preset, a run's config.yaml)."""
    (tmp_path / "c.yaml").write_text("model:\n  rope_theta: 500000.0\n  num_layers: 2\n")
    msg = load_error(path=tmp_path / "c.yaml")
    assert msg == "model.rope_theta is now model.rope.theta; rename the key."
    (tmp_path / "new.yaml").write_text("model:\n  rope:\n    theta: 500000.0\n")
    assert config.load(tmp_path / "new.yaml").model.rope.theta == 500000.0


# ------------------------------------------------------------------------- includes


def test_include_merges_and_including_file_wins(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "model:\n  num_layers: 7\n  d_model: 128\ntrain:\n  steps: 5\n"
    )
    (tmp_path / "run.yaml").write_text("include: base.yaml\nmodel:\n  num_layers: 2\n")
    cfg = config.load(tmp_path / "run.yaml")
    assert cfg.model.num_layers == 2  # the including file wins
    assert cfg.model.d_model == 128  # sibling keys of the included section survive
    assert cfg.train.steps == 5


def test_self_include_is_config_error(tmp_path):
    (tmp_path / "loop.yaml").write_text("include: [loop.yaml]\n")
    assert "includes itself" in load_error(path=tmp_path / "loop.yaml")


def test_include_cycle_through_two_files(tmp_path):
    (tmp_path / "a.yaml").write_text("include: b.yaml\n")
    (tmp_path / "b.yaml").write_text("include: a.yaml\n")
    assert "includes itself" in load_error(path=tmp_path / "a.yaml")


# ------------------------------------------------------------------------- combinations


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.num_heads=4", "model.num_kv_heads=3"], "model.num_kv_heads"),
        (["model.head_dim=33"], "model.head_dim"),
        (["data.seq_len=4096"], "data.seq_len"),
    ],
)
def test_impossible_combination(overrides, key):
    assert key in load_error(*overrides)


def test_vocab_size_at_byte_vocabulary_is_enough():
    from jaxllm.data import check_vocab

    cfg = config.load(None, ["model.vocab_size=258"])
    check_vocab(cfg.data, cfg.model.vocab_size)
    with pytest.raises(ConfigError, match=r"model.vocab_size \(257\) is smaller .* \(258\)"):
        check_vocab(cfg.data, 257)


def test_batch_not_divisible_by_data_parallel_size():
    cfg = Config(mesh=MeshConfig(data=8), train=TrainConfig(global_batch_size=12))
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        cfg.validate(num_devices=8)
    ok = dataclasses.replace(cfg, train=TrainConfig(global_batch_size=16))
    assert ok.validate(num_devices=8) is ok


def test_mesh_product_must_equal_device_count():
    cfg = Config(mesh=MeshConfig(data=2))  # every other check passes with 2-way data parallel
    with pytest.raises(ConfigError) as e:
        cfg.validate(num_devices=8)
    assert "mesh.data=2" in str(e.value) and "8 devices" in str(e.value)
    assert cfg.validate(num_devices=2) is cfg
    assert config.mesh_degrees(MeshConfig(data=2, fsdp=-1), 8)["fsdp"] == 4


def test_two_auto_degrees():
    with pytest.raises(ConfigError) as e:
        Config(mesh=MeshConfig(data=-1, fsdp=-1)).validate(num_devices=8)
    assert "mesh.data" in str(e.value) and "mesh.fsdp" in str(e.value)


# ------------------------------------------------------------------------- dump / load


def test_dump_load_round_trip(tmp_path):
    rope = RopeConfig(theta=5e5, scaling="llama3", factor=8.0, original_max_len=8192)
    cfg = Config(
        model=ModelConfig(head_dim=64, norm_eps=1e-6, remat="dots", tie_embeddings=True, rope=rope),
        mesh=MeshConfig(data=2, fsdp=-1),
        optim=dataclasses.replace(Config().optim, lr=2.5e-4, clip_norm=None),
        train=TrainConfig(sample_prompt="null: 123"),  # a string YAML would otherwise parse
    )
    assert cfg != Config()
    config.dump(cfg, tmp_path / "config.yaml")
    assert config.load(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize(
    "override",
    [
        "model.num_kv_heads=0",
        "model.num_heads=0",
        "train.grad_accum_steps=0",
        "train.steps=-5",
        "model.num_layers=0",
        "train.global_batch_size=0",
    ],
)
def test_non_positive_sizes_are_config_errors(override):
    assert override.split("=")[0] in load_error(override)


def test_yaml_1_2_scalars():
    cfg = config.load(None, ["optim.lr=1e-3", "train.sample_prompt=no", "run.dir=on"])
    assert cfg.optim.lr == 1e-3 and cfg.train.sample_prompt == "no" and cfg.run.dir == "on"
    assert "checkpoint.save_final" in load_error("checkpoint.save_final=yes")


# ------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    "arg, needle",
    [
        ("model.num_kv_heads=3", "model.num_kv_heads"),
        ("model.num_layer=3", "model.num_layers"),
        ("model.rope_theta=1e6", "model.rope.theta"),
        ("train.steps=ten", "train.steps"),
        ("does/not/exist.yaml", "does/not/exist.yaml"),
    ],
)
def test_cli_config_mistake_exits_2_with_one_line(arg, needle):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxllm", "train", arg],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]
    assert elapsed < 30, f"took {elapsed:.1f}s: the error should come before any compilation"


def test_cli_takes_options_and_overrides_in_any_order():
    from jaxllm.cli import parse

    ns = parse(["plan", "configs/runs/llama3_8b.yaml", "--devices", "8", "mesh.fsdp=8"])
    assert ns.devices == 8 and ns.args == ["configs/runs/llama3_8b.yaml", "mesh.fsdp=8"]
    ns = parse(["generate", "runs/x", "--prompt", "hi", "generate.top_k=5", "--seed", "3"])
    assert ns.args == ["runs/x", "generate.top_k=5"] and ns.prompt == ["hi"] and ns.seed == 3
    ns = parse(["train", "train.steps=3", "--num-processes", "2", "optim.lr=1e-3"])
    assert ns.args == ["train.steps=3", "optim.lr=1e-3"] and ns.num_processes == 2
    for bad in (["train", "--bogus"], ["plan", "a.yaml", "--devices", "8", "b.yaml"]):
        with pytest.raises(SystemExit) as e:
            parse(bad)
        assert e.value.code == 2


@pytest.mark.parametrize(
    "preset", sorted((REPO / "configs/runs").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_run_preset_loads_and_names_its_objective(preset):
    """Each run preset is a valid config whose objective builds: on 8 devices, or on the
    device count its mesh fixes (every axis given, none -1: a single-GPU preset)."""
    cfg = config.load(preset)
    axes = ("stage", "data", "fsdp", "tensor", "sequence", "expert")
    sizes = [getattr(cfg.mesh, p + a) for a in axes for p in ("", "dcn_")]
    cfg.validate(8 if -1 in sizes else math.prod(sizes))
    assert callable(objectives.from_config(cfg))


def test_each_alignment_objective_has_a_preset():
    names = {config.load(p).train.objective for p in (REPO / "configs/runs").glob("*.yaml")}
    assert {"dpo", "ipo", "simpo", "orpo", "reward", "grpo", "ppo", "distill"} <= names
