"""What a research script meets when it uses the pieces from Python: names where the README puts
them, docstrings, and one clear error for a wrong argument instead of a failure deep inside."""

from __future__ import annotations

import functools
import importlib
import inspect
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxllm
from jaxllm import config

TINY = config.ModelConfig(
    vocab_size=64,
    d_model=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    mlp_dim=64,
    max_seq_len=8,
    dtype="float32",
)


def test_generate_and_its_config_come_from_one_module():
    # the README's library call: jaxllm.infer.generate(model, prompts, GenerateConfig(...))
    from jaxllm.infer import GenerateConfig, generate

    model = jaxllm.Transformer(TINY, rngs=nnx.Rngs(0))
    out = generate(model, [[1, 2, 3]], GenerateConfig(max_new_tokens=2))
    assert GenerateConfig is config.GenerateConfig
    assert len(out.tokens[0]) == 2


def test_an_uncalled_objective_factory_is_a_type_error_naming_the_call():
    tx = optax.sgd(1e-2)
    state = jaxllm.init_state(TINY, tx, jaxllm.make_mesh(config.MeshConfig()), seed=0)
    tokens = jnp.ones((2, 8), jnp.int32)
    batch = {
        "inputs": tokens,
        "targets": tokens,
        "loss_mask": jnp.ones((2, 8)),
        "positions": jnp.broadcast_to(jnp.arange(8), (2, 8)),
        "segment_ids": tokens,
    }
    step = functools.partial(
        jaxllm.train_step,
        graphdef=jaxllm.abstract_model(TINY)[0],
        tx=tx,
        lr_schedule=lambda _: 1e-2,
        objective=jaxllm.next_token,  # the factory, not the objective it makes
    )
    with pytest.raises(
        TypeError, match=r"returned function, not jaxllm.ObjectiveOutput.*next_token\(\)"
    ):
        jax.eval_shape(step, state, batch)
    assert jax.eval_shape(functools.partial(step, objective=jaxllm.next_token()), state, batch)


@pytest.mark.parametrize(
    "tokens",
    [jnp.ones((1, 4)), jnp.ones((4,), jnp.int32), jnp.ones((1, 4, 1), jnp.int32)],
    ids=["float", "1-D", "3-D"],
)
def test_token_ids_must_be_an_integer_batch(tokens):
    model = jaxllm.Transformer(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"token ids must be an integer array \[batch, length\]"):
        model(tokens)
    assert model([[1, 2, 3]]).logits.shape == (1, 3, 64)  # nested lists are arrays too


def test_learned_positions_refuse_more_tokens_than_they_have():
    cfg = config.ModelConfig(**{**TINY.__dict__, "position": "learned"})
    model = jaxllm.Transformer(cfg, rngs=nnx.Rngs(0))
    assert model(jnp.ones((1, 8), jnp.int32)).logits.shape == (1, 8, 64)
    with pytest.raises(ValueError, match="9 tokens exceed the 8 learned positions"):
        model(jnp.ones((1, 9), jnp.int32))  # used to reuse the last row for the ninth


def test_flash_attention_names_the_shapes_it_takes():
    q = k = jnp.ones((64, 4, 32))  # no batch axis
    with pytest.raises(ValueError, match=r"want q \[B, L, H, K\] and k, v \[B, S, G, K\]"):
        jaxllm.flash_attention(q, k, k, interpret=True)


def test_attention_kernels_refuse_integer_inputs():
    from jaxllm.kernels.decode_attention import decode_attention, quantize_cache

    ids = jnp.ones((1, 64, 4, 32), jnp.int32)  # used to return an int32 "attention"
    with pytest.raises(TypeError, match="floating-point inputs; got q int32, k int32, v int32"):
        jaxllm.flash_attention(ids, ids, ids, interpret=True)
    cache = quantize_cache(jnp.ones((1, 2, 64, 32)), jnp.ones((1, 2, 64, 32)), "float32")
    with pytest.raises(TypeError, match="floating-point inputs; got q int32"):
        decode_attention(ids[:, :1], cache, jnp.array([10]), interpret=True)


PUBLIC = [
    "jaxllm",
    "jaxllm.config",
    "jaxllm.model",
    "jaxllm.objectives",
    "jaxllm.train",
    "jaxllm.sharding",
    "jaxllm.kernels",
    "jaxllm.checkpoint",
    "jaxllm.infer",
    "jaxllm.infer.engine",
    "jaxllm.compress",
    "jaxllm.convert",
    "jaxllm.load",
    "jaxllm.optim",
    "jaxllm.quantize",
    "jaxllm.prune",
    "jaxllm.merge",
    "jaxllm.evaluate",
]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_functions_and_classes_say_what_they_are(name):
    module = importlib.import_module(name)
    names = getattr(module, "__all__", None) or [
        k
        for k, v in vars(module).items()
        if not k.startswith("_") and getattr(v, "__module__", None) == name
    ]
    values = {k: getattr(module, k) for k in names}
    # __doc__, not inspect.getdoc: a class without its own docstring would show its base's
    undocumented = [
        k
        for k, v in values.items()
        if (inspect.isroutine(v) or inspect.isclass(v) or k == "Objective")
        and not (v.__doc__ or "").strip()
    ]
    assert undocumented == []


def test_a_whole_config_where_a_section_belongs_is_a_type_error():
    whole = config.Config()
    with pytest.raises(
        TypeError, match=r"built from a ModelConfig \(a Config's .model\), not Config"
    ):
        jaxllm.init_state(whole, optax.sgd(1e-2), jaxllm.make_mesh(whole.mesh), seed=0)
    with pytest.raises(TypeError, match=r"make_mesh takes a MeshConfig \(a Config's .mesh\)"):
        jaxllm.make_mesh(whole)


def test_an_engine_request_is_token_ids_and_sampling_params():
    from jaxllm.infer.engine import Engine, SamplingParams

    engine = Engine(jaxllm.Transformer(TINY, rngs=nnx.Rngs(0)), num_pages=8, page_size=16)
    for prompt in ["hello", [1.0, 2.0]]:
        with pytest.raises(TypeError, match="a prompt is a sequence of integer token ids"):
            engine.add_request(prompt, SamplingParams(max_tokens=1))
    with pytest.raises(TypeError, match="params must be a SamplingParams, not dict"):
        engine.add_request([1, 2], {"max_tokens": 1})
    assert engine.num_waiting == 0  # nothing queued by the refusals
    for prompt in [np.array([1, 2]), jnp.array([1, 2]), [np.int64(1), 2]]:
        engine.add_request(prompt, SamplingParams(max_tokens=1))
    assert engine.num_waiting == 3


def test_subpackages_are_attributes_of_a_bare_import_that_stays_light():
    # the docs name calls as jaxllm.infer.generate, jaxllm.plan.memory_bill, ...
    code = (
        "import sys, jaxllm; assert 'jax' not in sys.modules; "
        "jaxllm.infer.generate, jaxllm.plan.memory_bill, jaxllm.optim.keep_zeros, "
        "jaxllm.metrics.param_counts, jaxllm.compress.rtn, jaxllm.parallel; "
        "assert not hasattr(jaxllm, 'no_such_part')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_heads": 5, "num_kv_heads": 5}, r"d_model \(32\) is not divisible by .*num_heads"),
        ({"num_kv_heads": 3}, r"num_heads \(4\) must be divisible by model.num_kv_heads \(3\)"),
        ({"dtype": "int8"}, "model.dtype must be float32, bfloat16 or float16"),
        ({"mlp_dim": 0}, "model.mlp_dim must be at least 1, not 0"),
    ],
)
def test_a_model_config_built_in_python_is_checked_when_the_model_is_built(change, message):
    cfg = config.ModelConfig(**{**TINY.__dict__, **change})
    with pytest.raises(config.ConfigError, match=message):
        jaxllm.Transformer(cfg, rngs=nnx.Rngs(0))  # head_dim 6 / a reshape error before
    with pytest.raises(config.ConfigError, match=message):
        jaxllm.abstract_model(cfg)
    with pytest.raises(config.ConfigError, match=message):  # the same check as a run's
        config.Config(model=cfg, data=config.DataConfig(seq_len=8)).validate()


def test_an_inconsistent_config_is_refused_before_anything_is_written(tmp_path):
    # the default data.seq_len (256) beyond the model's 8 positions: load_model refused the run
    cfg = config.Config(model=TINY)
    message = r"data.seq_len \(256\) exceeds model.max_seq_len \(8\)"
    with pytest.raises(config.ConfigError, match=message):
        config.dump(cfg, tmp_path / "config.yaml")
    params = {"w": np.zeros(2, np.float32)}
    with pytest.raises(config.ConfigError, match=message):
        jaxllm.checkpoint.save_params(
            tmp_path / "checkpoints", params, step=0, config=config.to_dict(cfg), tokenizer={}
        )
    assert list(tmp_path.iterdir()) == []
    config.dump(config.Config(model=TINY, data=config.DataConfig(seq_len=8)), tmp_path / "ok.yaml")
    assert config.load(tmp_path / "ok.yaml").data.seq_len == 8


def test_compression_options_name_the_parameter_and_check_the_sparsity():
    from jaxllm import prune, quantize

    with pytest.raises(config.ConfigError, match=r"sparsity \(--sparsity\) 1.5 is outside"):
        prune.options("magnitude", 1.5, None)  # was accepted, refused later as --sparsity
    with pytest.raises(config.ConfigError, match=r"^method \(--method\) gptq9 is not a"):
        quantize.options("gptq9", None, None, None)


def test_prune_run_leaves_printing_to_the_command(tmp_path, capfd):
    from jaxllm import bench, prune

    small = ["model.vocab_size=64", "model.d_model=32", "model.num_layers=1", "model.mlp_dim=64"]
    src = bench.write_random_run(tmp_path / "src", overrides=small)
    capfd.readouterr()
    how = prune.options("magnitude", 0.5, None)
    assert prune.prune_run(src, tmp_path / "out", how) == tmp_path / "out"
    assert capfd.readouterr() == ("", "")  # the CLI prints what it removed, not the function


@pytest.mark.parametrize("name", [n for n in PUBLIC if n.count(".") == 1])
def test_a_public_module_lists_its_names_and_none_of_its_imports(name):
    module = importlib.import_module(name)
    listed = set(module.__all__)  # dir() showed contextlib, dataclasses, jax, ...
    assert all(hasattr(module, k) for k in listed)
    own = {
        k
        for k, v in vars(module).items()
        if not k.startswith(("_", "cmd_", "add_"))  # the command's hooks are the CLI's
        and (inspect.isroutine(v) or inspect.isclass(v))
        and v.__module__ == name
    }
    assert own <= listed
    assert not listed & {"annotations", "dataclasses", "jax", "np", "Path"}


def test_importing_the_checkpoint_code_leaves_the_root_logger_to_the_user():
    # Orbax's import used to add a root handler (absl's vlog calls logging.basicConfig), so
    # the script's own basicConfig(level=INFO) below did nothing
    code = (
        "import logging, jaxllm.train, jaxllm.load, jaxllm.convert; "
        "logging.basicConfig(level=logging.INFO); assert logging.root.level == logging.INFO"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
