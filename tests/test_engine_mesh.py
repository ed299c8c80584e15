"""The inference engine on a mesh: parameters, pages and slots sharded (data x tensor, fsdp,
MoE experts over `expert`) give the greedy tokens of the one-device engine and of `generate`,
with one compile per query bucket."""

import jax
import numpy as np
import pytest
from conftest import tiny_model
from jax.sharding import PartitionSpec as P

from jaxllm import sharding
from jaxllm.config import ConfigError, GenerateConfig, MeshConfig, MoEConfig
from jaxllm.infer import generate
from jaxllm.infer.engine import Engine, SamplingParams, runner
from jaxllm.model.transformer import build

RNG = np.random.default_rng(1)
PROMPTS = [RNG.integers(1, 64, size=n).tolist() for n in (3, 8, 1, 6, 5)]
MAX_TOKENS = 5
ENGINE = dict(max_num_seqs=3, page_size=4, num_pages=6, chunk_size=4)  # preempts


@pytest.fixture(scope="module")
def dense():
    return build(tiny_model(init_std=0.5, max_seq_len=32, num_kv_heads=4), seed=0)


@pytest.fixture(scope="module")
def moe():
    cfg = MoEConfig(num_experts=4, experts_per_token=2, num_shared_experts=1, first_dense_layers=1)
    return build(tiny_model(init_std=0.5, max_seq_len=32, num_kv_heads=4, moe=cfg), seed=1)


def _generate_alone(model):
    """`generate` on one device: the reference every layout must give."""
    gen = GenerateConfig(kv_cache_dtype="float32", max_new_tokens=MAX_TOKENS)
    return generate(model, PROMPTS, gen).tokens


@pytest.fixture(scope="module")
def want(dense):
    return _generate_alone(dense)


@pytest.fixture(scope="module")
def one_device(dense, want):
    """(tokens, logprobs) of the engine on one device, which are generate's tokens."""
    engine = Engine(dense, **ENGINE)
    tokens, logprobs = _run(engine)
    assert tokens == want and engine.num_preemptions > 0
    return tokens, logprobs


def _run(engine):
    """Two requests join per step (continuous batching); (tokens, logprobs) per prompt."""
    pending, outs, ids = list(enumerate(PROMPTS)), {}, {}
    params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=True)
    while pending or engine.has_unfinished():
        for _ in range(2):
            if pending:
                i, p = pending.pop(0)
                ids[engine.add_request(p, params)] = i
        for o in engine.step().finished:
            outs[ids[o.request_id]] = o
    return [outs[i].tokens for i in range(len(PROMPTS))], [outs[i].logprobs for i in outs]


def _mesh(**degrees):
    return sharding.make_mesh(MeshConfig(**{"data": 1, **degrees}))


@pytest.mark.parametrize(
    "degrees",
    [dict(data=2, tensor=4), pytest.param(dict(data=2, fsdp=2, tensor=2), marks=pytest.mark.slow)],
    ids=["dp2-tp4", "dp2-fsdp2-tp2"],
)
def test_engine_on_a_mesh_equals_one_device_and_generate(dense, want, one_device, degrees):
    mesh = _mesh(**degrees)
    engine = Engine(dense, mesh=mesh, **ENGINE)
    # laid out as the logical axes say: kv heads over tensor (the pages' too), slots over data
    k_proj = engine._state["layers"]["attn"]["k_proj"][...]
    assert k_proj.sharding.spec == P(None, "fsdp", "tensor", None)
    assert engine._kv.k.sharding.spec == P(None, None, "tensor", None, None)
    assert len(engine._slots) % (degrees["data"] * degrees.get("fsdp", 1)) == 0
    assert dense.layers.attn.k_proj[...].sharding.num_devices == 1  # the model is not moved
    free, traces = engine.num_free_pages, runner.TRACES[0]
    tokens, logprobs = _run(engine)
    assert tokens == want
    for a, b in zip(logprobs, one_device[1]):
        np.testing.assert_allclose(a, b, atol=1e-4)
    traces = runner.TRACES[0] - traces  # one compile per (Q, table width) pair, as on one device
    assert traces <= len(engine.query_buckets) * len(engine.page_buckets) and traces <= 6
    assert engine.num_preemptions > 0 and engine.num_free_pages == free


@pytest.mark.parametrize(
    "degrees",
    [
        dict(expert=2, data=2, tensor=2),
        pytest.param(dict(expert=4, tensor=2), marks=pytest.mark.slow),
    ],
    ids=["ep2-dp2-tp2", "ep4-tp2"],
)
def test_moe_engine_with_experts_over_the_expert_axis_equals_generate(moe, degrees):
    """Dropless MoE (a dense first layer, then experts and a shared expert): the experts
    split over `expert`, the slots over data x expert, the tokens of one device."""
    want = _generate_alone(moe)
    mesh = _mesh(**degrees)
    engine = Engine(moe, mesh=mesh, mesh_config=MeshConfig(**{"data": 1, **degrees}), **ENGINE)
    gate = engine._state["moe_layers"]["moe"]["mlp"]["gate_proj"][...]
    assert gate.sharding.spec == P(None, "expert", "fsdp", "tensor")
    assert _run(engine)[0] == want


def test_a_one_device_mesh_runs_as_no_mesh(dense, want):
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    engine = Engine(dense, mesh=mesh, **ENGINE)
    assert len(engine._slots) == ENGINE["max_num_seqs"]
    assert _run(engine)[0] == want


def test_a_mesh_the_model_does_not_split_on_is_refused(dense):
    """Two kv heads cannot split four ways; pipeline stages and a split sequence are not the
    engine's layouts: each refused before anything compiles."""
    model = build(tiny_model(num_kv_heads=2), seed=0)
    with pytest.raises(ConfigError, match="mesh.tensor"):
        Engine(model, mesh=_mesh(tensor=4, data=2), **ENGINE)
    with pytest.raises(ValueError, match="stage=1 and sequence=1"):
        Engine(dense, mesh=_mesh(sequence=2, data=4), **ENGINE)


def test_jaxllm_serve_runs_the_engine_on_the_runs_mesh(small_run, monkeypatch):
    """`jaxllm serve RUN mesh.*=...` restores the run onto that mesh and its engine runs there
    (the HTTP server itself is left out: uvicorn's run is a no-op here)."""
    import uvicorn
    from flax import nnx

    from jaxllm.cli import main
    from jaxllm.serve import cli as serve_cli

    built = {}

    def spy(*args, **kw):
        built["app"], built["worker"] = serve_cli_build(*args, **kw)
        return built["app"], built["worker"]

    serve_cli_build = serve_cli.build
    monkeypatch.setattr(serve_cli, "build", spy)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    monkeypatch.setattr(serve_cli.signal, "signal", lambda *a: None)
    mesh_args = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    assert main(["serve", str(small_run), *mesh_args, "--max-num-seqs", "3"]) == 0
    engine = built["worker"].engine
    assert dict(engine._parallel.mesh.shape) == dict(
        stage=1, data=2, fsdp=2, tensor=2, tensor2=1, sequence=1, expert=1
    )
    assert engine._kv.k.sharding.spec == P(None, None, "tensor", None, None)
    assert len(engine._slots) == 4  # 3 rounded up to split over data x fsdp
    prompts = [[5, 9, 2, 7], [11, 3]]
    got = [o[0].tokens for o in engine.generate(prompts, SamplingParams(max_tokens=4))]
    model = nnx.merge(engine._graphdef, engine._state)
    gen = GenerateConfig(kv_cache_dtype="float32", max_new_tokens=4)
    assert got == [t[:4] for t in generate(model, prompts, gen).tokens]


def test_parameters_already_on_the_mesh_stay_as_they_are(dense):
    """A training state's parameters (here replicated, as ZeRO-1 keeps them) are used in place,
    not copied into the logical layout; those on one device are moved."""
    from flax import nnx
    from jax.sharding import NamedSharding

    mesh = _mesh(data=2, tensor=4)
    _, state = nnx.split(dense)
    arrays = nnx.to_pure_dict(state)
    arrays["layers"]["attn"]["k_proj"] = jax.device_put(
        arrays["layers"]["attn"]["k_proj"], NamedSharding(mesh, P())
    )
    nnx.replace_by_pure_dict(state, arrays)
    placed = runner.place_params(state, sharding.Parallel(mesh))
    assert placed["layers"]["attn"]["k_proj"][...] is arrays["layers"]["attn"]["k_proj"]
    assert placed["layers"]["attn"]["q_proj"][...].sharding.spec == P(None, "fsdp", "tensor", None)


@pytest.mark.parametrize("how", [dict(method="rtn", bits=4, group_size=16), dict(method="fp8")])
def test_a_quantized_model_runs_on_a_mesh_as_generate_runs_it(dense, how):
    """A quantized run's weights (codes, scales and zero points, each with its own axes; as
    `jaxllm serve QUANTIZED_RUN` hands them over, already on the run's one-device mesh) lie
    on the engine's mesh and give `generate`'s tokens."""
    from flax import nnx

    from jaxllm import compress
    from jaxllm.compress.weights import is_quantized
    from jaxllm.config import QuantizeConfig
    from jaxllm.model.layers import logical_axes

    graphdef, params, rest = nnx.split(dense, nnx.Param, ...)
    one = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    pure = jax.device_put(nnx.to_pure_dict(params), sharding.named(one, ()))
    q = compress.quantize_params(pure, logical_axes(params), QuantizeConfig(**how), one)
    nnx.replace_by_pure_dict(params, q)
    model = nnx.merge(graphdef, params, rest)
    assert is_quantized(model.layers.attn.o_proj.get_value())
    want = _generate_alone(model)
    engine = Engine(model, mesh=_mesh(data=2, tensor=4), **ENGINE)
    o_proj = engine._state["layers"]["attn"]["o_proj"].get_value()
    assert o_proj.codes.sharding.spec == P(None, "tensor", None, "fsdp")
    assert _run(engine)[0] == want
