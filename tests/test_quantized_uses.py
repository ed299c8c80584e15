"""A quantized run (`jaxllm quantize`) in use: as the frozen base of LoRA and as a held
teacher, decoding over a quantized KV cache, and a quantized MoE run (int4, and W8A8)
sharded over the expert axis.

LoRA trains on its packed codes as QLoRA does on NF4: the train state's frozen base holds the
`QuantizedTensor`s, the run's config.yaml records the base's `quantize.*`, the run resumes, and
its model computes W_q + s A B through the matmul seam, which the merged (dequantized) weights
reproduce. A distillation teacher that is a quantized run is held in its codes too.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import yaml
from conftest import SMALL_RUN
from flax import nnx
from trained_runs import OUT, made_by

import jaxllm
from jaxllm import config, sharding
from jaxllm.cli import main
from jaxllm.config import MeshConfig
from jaxllm.load import load_weights, restore
from jaxllm.model import abstract_model, coded, quantized
from jaxllm.train import companions

LORA = ["peft.method=lora", "peft.rank=4", "optim.lr=1e-2"]


def _is_q(x) -> bool:
    return isinstance(x, quantized.QuantizedTensor)


@pytest.fixture(scope="module")
def q_run(small_run):
    """The small run in int4 groups of 32 (shared with test_convert_quantized: read-only)."""
    opts = ["--method", "rtn", "--bits", "4", "--group-size", "32"]
    return made_by("small-int4-g32", "quantize", small_run, OUT, *opts)


@pytest.fixture(scope="module")
def lora_run(q_run, tmp_path_factory):
    run = tmp_path_factory.mktemp("qlora_base") / "lora"
    argv = ["train", *SMALL_RUN, *LORA, f"checkpoint.init_from={q_run}", "train.steps=4",
            "checkpoint.every=2", f"run.dir={run}"]  # fmt: skip
    assert main(argv) == 0
    return run


def _losses(run) -> list[float]:
    rows = [yaml.safe_load(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_lora_trains_on_the_packed_codes(q_run, lora_run):
    recorded = yaml.safe_load((lora_run / "config.yaml").read_text())["quantize"]
    assert (recorded["method"], recorded["bits"], recorded["group_size"]) == ("rtn", 4, 32)
    losses = _losses(lora_run)
    assert len(losses) == 4 and losses[-1] < losses[0]

    restored = restore(lora_run, mesh=sharding.make_mesh(MeshConfig()))
    packed = [x for x in jax.tree.leaves(restored.frozen, is_leaf=_is_q) if _is_q(x)]
    assert len(packed) == 7  # q, k, v, o, gate, up, down: stacked over the layers
    base = restore(q_run, mesh=sharding.make_mesh(MeshConfig()))
    for a, b in zip(
        jax.tree.leaves(restored.frozen, is_leaf=_is_q), jax.tree.leaves(base.params, is_leaf=_is_q)
    ):  # the base is the quantized run's codes, bit for bit
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert all(not _is_q(x) for x in jax.tree.leaves(restored.params, is_leaf=_is_q))


def test_the_seam_computes_what_the_merged_weights_do(q_run, lora_run):
    mesh = sharding.make_mesh(MeshConfig())
    tokens = np.random.default_rng(0).integers(0, 320, (2, 24)).astype(np.int32)
    model = jaxllm.load_model(lora_run)
    got = np.asarray(model(tokens).logits)
    cfg = restore(lora_run, mesh=mesh).cfg
    merged, state = load_weights(lora_run, cfg.model, mesh)  # W_deq + s A B, one array each
    assert all(not _is_q(x) for x in jax.tree.leaves(merged, is_leaf=_is_q))
    graphdef = abstract_model(cfg.model)[0]
    want = np.asarray(nnx.merge(graphdef, merged, *([state] if state else []))(tokens).logits)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
    base = np.asarray(jaxllm.load_model(q_run)(tokens).logits)
    assert np.abs(got - base).max() > 1e-3  # the adapters changed the quantized model


def test_resumes_on_the_quantized_base(q_run, lora_run, tmp_path):
    import shutil

    run = tmp_path / "lora"
    shutil.copytree(lora_run, run)
    assert main(["train", str(run / "config.yaml"), f"run.dir={run}", "train.steps=6"]) == 0
    assert len(_losses(run)) == 6


def test_a_lora_run_on_a_quantized_base_quantizes_afresh(lora_run, tmp_path):
    """Its merged model (the dequantized base plus s A B) is quantized by the command's own
    options, none of the base's (int4 in groups of 32) carried over."""
    out = tmp_path / "again"
    assert main(["quantize", str(lora_run), str(out), "--method", "rtn", "--asymmetric"]) == 0
    q = config.load(out / "config.yaml").quantize
    assert (q.method, q.bits, q.group_size, q.symmetric) == ("rtn", 8, 0, False)
    tokens = np.random.default_rng(0).integers(0, 320, (2, 24)).astype(np.int32)
    want = np.asarray(jaxllm.load_model(lora_run)(tokens).logits)
    got = np.asarray(jaxllm.load_model(out)(tokens).logits)
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max())


def test_quantized_teacher_is_held_in_its_codes(q_run, small_run, tmp_path):
    keys = [
        "train.objective=distill",
        f"train.teacher={q_run}",
        f"checkpoint.init_from={small_run}",
    ]
    argv = ["train", *SMALL_RUN, *keys, "train.steps=2", f"run.dir={tmp_path / 'student'}"]
    assert main(argv) == 0
    cfg = config.load(tmp_path / "student" / "config.yaml")
    held = companions.resolve_others(cfg, companions.from_config(cfg))
    assert held["teacher"].quantize.method == "rtn"
    loaded = companions.load(held, sharding.make_mesh(MeshConfig()))
    assert any(_is_q(x) for x in jax.tree.leaves(loaded["teacher"]["params"], is_leaf=_is_q))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["peft.method=qlora"], "train LoRA adapters on it (peft.method=lora)"),
        ([], "holds quantized weights (quantize.method=rtn, jaxllm quantize), which do not train"),
        (["peft.method=lora", "quantize.method=rtn", "quantize.bits=8"], "leave quantize.* unset"),
    ],
    ids=["qlora", "full", "other-quantize"],
)
def test_refusals(q_run, tmp_path, capsys, extra, message):
    argv = ["train", *SMALL_RUN, *extra, f"checkpoint.init_from={q_run}", "train.steps=2",
            f"run.dir={tmp_path / 'r'}"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxllm:") and message in err[0], err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "method, dispatch",
    [
        ("rtn", "dropless"),
        ("fp8", "dropless"),
        pytest.param("smoothquant", "dropless", marks=pytest.mark.slow),
        pytest.param("rtn", "capacity", marks=pytest.mark.slow),
        pytest.param("smoothquant", "capacity", marks=pytest.mark.slow),
    ],
)
def test_quantized_experts_are_the_same_expert_parallel(small_moe, tmp_path, method, dispatch):
    """A MoE run quantized to int4 (rtn), or to W8A8 (fp8 with fp8 activations, smoothquant's
    int8), whose routed experts quantize each token's row in the dispatch: its routed and
    shared experts' codes shard over the expert axis (4 experts on expert=4 x fsdp=2), and the
    logits equal one device's."""
    opts = {
        "rtn": ["--bits", "4", "--group-size", "32"],
        "smoothquant": ["--samples", "8"],
        "fp8": ["quantize.fp8_activations=true"],
    }
    assert main(["quantize", str(small_moe), str(tmp_path / "q"), "--method", method,
                 *opts[method]]) == 0  # fmt: skip
    tokens = np.random.default_rng(3).integers(0, 320, (8, 16))
    load = dict(overrides=[f"model.moe.dispatch={dispatch}"])
    one = jaxllm.load_model(
        tmp_path / "q", mesh=sharding.make_mesh(MeshConfig(), jax.devices()[:1]), **load
    )
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=2, expert=4))
    eight = jaxllm.load_model(tmp_path / "q", mesh=mesh, **load)
    assert eight.moe_layers.moe.mlp.cfg.dispatch == dispatch
    gate = eight.moe_layers.moe.mlp.gate_proj.get_value()  # codes [N, E, D(/2), F]
    assert _is_q(gate) if method == "rtn" else coded.w8a8(gate)
    assert "expert" in str(gate.codes.sharding.spec) and len(gate.codes.sharding.device_set) == 8
    np.testing.assert_allclose(
        np.asarray(eight(tokens).logits), np.asarray(one(tokens).logits), rtol=1e-5, atol=1e-5
    )


def test_quantized_weights_with_a_quantized_kv_cache(q_run, capsys):
    """An int4 model decodes over int8 and int4 KV caches: scored through the cache, a float
    cache gives the model's own teacher-forced losses, an int8 cache nearly those, and the
    greedy predictions mostly agree; `jaxllm generate --kv-cache-dtype int8` runs on it."""
    from jaxllm.config import GenerateConfig
    from jaxllm.infer import score_with_cache

    model = jaxllm.load_model(q_run)
    tokens = (np.arange(96, dtype=np.int32).reshape(2, 48) * 11) % 300
    logp = jax.nn.log_softmax(np.asarray(model(tokens).logits, np.float32), axis=-1)
    want = -np.take_along_axis(np.asarray(logp)[:, 7:-1], tokens[:, 8:, None], -1)[..., 0]
    out = {k: score_with_cache(model, tokens, GenerateConfig(kv_cache_dtype=k), prefix=8)
           for k in ("float32", "int8", "int4")}  # fmt: skip
    np.testing.assert_allclose(out["float32"][0], want, atol=1e-4, rtol=1e-4)
    assert abs(out["int8"][0].mean() - want.mean()) < 0.01
    assert abs(out["int4"][0].mean() - want.mean()) < 0.1
    assert (out["int8"][1] == out["float32"][1]).mean() > 0.9
    capsys.readouterr()
    argv = ["generate", str(q_run), "--prompt", "def ", "--max-new-tokens", "6"]
    assert main([*argv, "--kv-cache-dtype", "int8"]) == 0
