"""DoRA (`peft.dora`, Hugging Face PEFT's use_dora): an imported PEFT DoRA adapter gives PEFT's
logits and PEFT's gradients, a DoRA run trains, resumes, and exports to PEFT (--peft) and to
transformers (--merge) with its own logits; what DoRA cannot do is refused in one line."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers as hf
from conftest import tiny_model
from flax import nnx
from hf_models import hf_logits, hf_model, run_cli, sample_tokens, save_hf, stderr_of_failure
from safetensors.numpy import load_file
from test_peft_hf import TRAIN

import jaxllm
from jaxllm import adapters, config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.config import ConfigError, PeftConfig
from jaxllm.model import build, lora
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state, layout

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def dora_adapter(tmp_path_factory):
    """(base HF dir, a PEFT DoRA adapter dir, the PeftModel): rank 4 on the attention and MLP
    projections of a Llama 2, with random B and magnitudes moved off the base's norms."""
    tmp = tmp_path_factory.mktemp("dora")
    model = hf_model("llama2", seed=1)
    src = save_hf(model, tmp / "hf")
    cfg = peft.LoraConfig(
        r=4, lora_alpha=6, use_dora=True, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    theirs = peft.get_peft_model(model, cfg).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))
    theirs.save_pretrained(tmp / "adapter")
    return src, tmp / "adapter", theirs


def _import(src, adapter, run) -> None:
    assert run_cli("convert", "import", src, run, "--peft", adapter, "model.dtype=float32") == 0


@pytest.mark.torch
def test_imported_dora_gives_peft_logits_and_exports_the_same_tensors(dora_adapter, tmp_path):
    src, adapter, theirs = dora_adapter
    run = tmp_path / "run"
    _import(src, adapter, run)
    assert config.load(run / "config.yaml").peft.dora
    tokens = sample_tokens()
    ours = np.asarray(jaxllm.load_model(run)(tokens).logits)
    np.testing.assert_allclose(ours, hf_logits(theirs, tokens), atol=1e-5, rtol=1e-5)
    assert run_cli("convert", "export", run, tmp_path / "back", "--peft") == 0
    original = load_file(str(adapter / "adapter_model.safetensors"))
    back = load_file(str(tmp_path / "back/adapter_model.safetensors"))
    assert sorted(back) == sorted(original)
    assert back["base_model.model.model.layers.1.mlp.up_proj.lora_magnitude_vector"].shape == (128,)
    for name, t in original.items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)


def _ce(logits, tokens):
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()


@pytest.mark.torch
def test_imported_dora_gives_peft_gradients(dora_adapter, tmp_path):
    """The gradients of A, B and m (the norm a constant, as PEFT's) equal PEFT's."""
    src, adapter, theirs = dora_adapter
    run = tmp_path / "run"
    _import(src, adapter, run)
    tokens = sample_tokens(3)
    graphdef, params, rest = nnx.split(jaxllm.load_model(run), lora.LoRAParam, ...)
    loss, grads = jax.value_and_grad(
        lambda p: _ce(nnx.merge(graphdef, p, rest)(tokens).logits, tokens)
    )(params)
    grads = nnx.to_pure_dict(grads)
    theirs.zero_grad()
    out = theirs(torch.tensor(tokens), labels=torch.tensor(tokens))
    out.loss.backward()
    np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
    named = dict(theirs.named_parameters())
    for i in range(2):
        for module, path in [
            ("self_attn.q_proj", ("attn", "q_proj")),
            ("self_attn.o_proj", ("attn", "o_proj")),
            ("mlp.down_proj", ("mlp", "down_proj")),
        ]:
            g = grads["layers"][path[0]]
            pre = f"base_model.model.model.layers.{i}.{module}."
            want = {
                "lora_a": named[pre + "lora_A.default.weight"].grad.numpy().T,
                "lora_b": named[pre + "lora_B.default.weight"].grad.numpy().T,
                "lora_magnitude": named[pre + "lora_magnitude_vector.default.weight"].grad.numpy(),
            }
            for part, w in want.items():
                got = np.asarray(g[f"{path[1]}_{part}"][i])
                if part == "lora_b":  # ours [r, *out], theirs (transposed) [r, out]
                    got = got.reshape(got.shape[0], -1)
                got = got.reshape(w.shape)  # o_proj's A: ours [heads, head_dim, r]
                scale = np.abs(w).max()
                np.testing.assert_allclose(got, w, atol=1e-4 * scale, err_msg=pre + part)
                assert scale > 0


@pytest.fixture(scope="module")
def dora_run(tmp_path_factory):
    """(base HF dir, a DoRA run on it trained 4 steps at a high lr, checkpointed at 2)."""
    tmp = tmp_path_factory.mktemp("dorarun")
    src = save_hf(hf_model("llama3.1"), tmp / "hf")
    assert run_cli("convert", "import", src, tmp / "base", "model.dtype=float32") == 0
    args = [tmp / "base/config.yaml", f"checkpoint.init_from={src}", "peft.method=lora"]
    args += ["peft.dora=true", "peft.rank=4", f"peft.targets=[{','.join(TARGETS)}]"]
    args += [*TRAIN, "optim.lr=2e-2", "checkpoint.every=2", "train.log_every=1"]
    assert run_cli("train", *args, f"run.dir={tmp / 'dora'}", "train.steps=4") == 0
    return src, tmp / "base", tmp / "dora", args


@pytest.mark.torch
def test_dora_run_trains_resumes_and_exports_to_peft_and_transformers(dora_run, tmp_path):
    src, base_run, run, args = dora_run
    tokens = sample_tokens()
    ours = np.asarray(jaxllm.load_model(run)(tokens).logits)
    assert np.abs(ours - np.asarray(jaxllm.load_model(base_run)(tokens).logits)).max() > 1e-2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 4 and losses[-1] < losses[0]
    # resume: a copy without step 4 trains step 3 and 4 again to the same adapters
    split = tmp_path / "split"
    shutil.copytree(run, split)
    shutil.rmtree(split / "checkpoints/4")
    assert run_cli("train", *args, f"run.dir={split}", "train.steps=4") == 0
    a, b = jaxllm.load_model(run), jaxllm.load_model(split)
    for x, y in zip(
        jax.tree.leaves(nnx.state(a, lora.LoRAParam)), jax.tree.leaves(nnx.state(b, lora.LoRAParam))
    ):
        np.testing.assert_array_equal(x, y)
    m = nnx.state(a, lora.LoRAParam)["layers"]["attn"]["q_proj_lora_magnitude"][...]
    assert m.shape[0] == 2

    assert run_cli("convert", "export", run, tmp_path / "ad", "--peft") == 0
    hf_base = hf.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(hf_base, tmp_path / "ad").eval()
    assert theirs.peft_config["default"].use_dora
    np.testing.assert_allclose(hf_logits(theirs, tokens), ours, atol=1e-4, rtol=1e-4)
    assert run_cli("convert", "export", run, tmp_path / "merged", "--merge") == 0
    merged = hf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", attn_implementation="eager"
    )
    np.testing.assert_allclose(hf_logits(merged.eval(), tokens), ours, atol=1e-4, rtol=1e-4)


def test_dora_refusals_are_one_line(capsys):
    for kwargs, message in [
        (dict(method="prompt", dora=True), "peft.dora decomposes a LoRA update"),
        (dict(method="lora", dora=True, keep_zeros=True), "peft.keep_zeros"),
    ]:
        with pytest.raises(ConfigError, match=message):
            PeftConfig(**kwargs).validate()
    err = stderr_of_failure(capsys, "train", "peft.method=adapter", "peft.dora=true")
    assert err.startswith("jaxllm: ") and err.count("\n") == 1


def _dora_family() -> config.ModelConfig:
    """MLA with dropless MoE and a shared expert: routed experts and MLA's absorbed weights
    read the merged weight (`lora.dense`), the rest the matmul seam's DoRA path."""
    moe = config.MoEConfig(
        num_experts=4, expert_mlp_dim=64, first_dense_layers=1, num_shared_experts=1
    )
    mla = config.MLAConfig(
        kv_lora_rank=64, q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16
    )
    return tiny_model(num_kv_heads=4, mla=mla, moe=moe)


def test_dora_starts_at_the_base_and_equals_its_merged_weights():
    cfg = _dora_family()
    peft_cfg = PeftConfig(method="lora", rank=4, alpha=8.0, targets=("all-linear",), dora=True)
    tokens = jnp.arange(24).reshape(2, 12) % cfg.vocab_size
    logits = nnx.jit(lambda m, t: m(t).logits)
    base = logits(build(cfg, 0), tokens)
    model = build(cfg, 0, peft_cfg)
    np.testing.assert_allclose(logits(model, tokens), base, rtol=0, atol=1e-5)
    for i, (_, module) in enumerate(nnx.iter_modules(model)):
        for name in list(vars(module)):
            v = getattr(module, name)
            key = jax.random.key(i)
            if name.endswith("_lora_b"):
                v[...] = 0.05 * jax.random.normal(key, v.shape, v.dtype)
            if name.endswith("_lora_magnitude"):
                v[...] = v[...] * (1 + 0.2 * jax.random.normal(key, v.shape, v.dtype))
    names = {n for _, m in nnx.iter_modules(model) for n in vars(m) if n.endswith("magnitude")}
    assert {"kv_b_proj_lora_magnitude", "gate_proj_lora_magnitude"} <= names
    unmerged = logits(model, tokens)
    assert float(jnp.max(jnp.abs(unmerged - base))) > 0.1
    graphdef, params, frozen, rest = nnx.split(model, lora.LoRAParam, nnx.Param, ...)
    plain = build(cfg, 0)
    nnx.update(plain, lora.merged_params(graphdef, params, frozen, rest))
    np.testing.assert_allclose(logits(plain, tokens), unmerged, atol=2e-5)


def test_qlora_dora_trains_the_magnitudes_from_the_nf4_base():
    cfg = config.Config(
        model=tiny_model(vocab_size=264, d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8, steps=4),
        optim=config.OptimConfig(lr=3e-2, warmup_steps=0, eps=1e-6),
        peft=PeftConfig(method="qlora", rank=4, targets=("q_proj", "down_proj"), dora=True),
    )
    cfg.validate(len(jax.devices()))
    mesh = sharding.make_mesh(cfg.mesh)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    m0 = np.asarray(state.params["layers"]["mlp"]["down_proj_lora_magnitude"])
    w = lora.as_array(state.frozen["layers"]["mlp"]["down_proj"], jnp.float32)
    np.testing.assert_allclose(m0, np.linalg.norm(np.asarray(w), axis=1), rtol=1e-6)  # NF4's
    losses, batch = [], to_global(synthetic_batch(cfg, seed=0), batch_sh)
    for _ in range(cfg.train.steps):  # one batch again and again: its loss must fall
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert np.abs(state.params["layers"]["mlp"]["down_proj_lora_magnitude"] - m0).max() > 1e-4


def test_dora_on_a_base_pruned_to_zeros_is_refused(tmp_path):
    """LoRA on an unstructured-pruned run keeps its zeros (peft.keep_zeros, set by itself);
    DoRA's rescaled outputs cannot, so it is refused in one line."""
    (tmp_path / "pruned").mkdir()
    (tmp_path / "pruned/config.yaml").write_text("prune:\n  method: magnitude\n")
    args = ["peft.method=lora", f"checkpoint.init_from={tmp_path / 'pruned'}"]
    assert adapters.pruned_base(config.load(None, args)).peft.keep_zeros
    with pytest.raises(ConfigError, match="peft.dora rescales whole outputs.*magnitude"):
        adapters.pruned_base(config.load(None, [*args, "peft.dora=true"]))


def _train_dora(mesh: dict, devices) -> tuple[list[float], dict]:
    cfg = config.Config(
        model=tiny_model(vocab_size=264, d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128),
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8, steps=3),
        optim=config.OptimConfig(lr=3e-2, warmup_steps=0, eps=1e-6),
        peft=PeftConfig(method="lora", rank=4, targets=("all-linear",), dora=True),
    )
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    losses = []
    for i in range(cfg.train.steps):
        state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


def test_dora_trains_the_same_on_one_device_and_sharded():
    """The norms over a weight's inputs are whole when fsdp and tensor split the weight: the
    same losses, and the same adapters and magnitudes (as tests/test_lora.py's tolerance)."""
    ref_losses, ref = _train_dora({}, jax.devices()[:1])
    losses, params = _train_dora(dict(data=2, fsdp=2, tensor=2), jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5), params, ref)
    m = params["layers"]["attn"]["o_proj_lora_magnitude"]
    assert m.shape == (2, 64)
