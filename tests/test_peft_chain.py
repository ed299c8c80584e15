"""Post-training chains through fine-tuning runs: `checkpoint.init_from` a LoRA or QLoRA run
starts from its merged model (`checkpoint.init_adapters=merge`, the default) or goes on with its
adapters over its base (`continue`), and a reference (DPO, GRPO's KL) is that starting model.
Runs go through `jaxllm.cli.main`: DPO from a LoRA and a QLoRA SFT run, merged and continued;
a combination that cannot work is one `jaxllm:` line, exit 2, with nothing changed; and (slow:
GRPO's rollouts compile a generator) the chain SFT-LoRA -> DPO -> GRPO -> export.

The QLoRA run is the LoRA SFT run's adapters on its NF4 base (its config.yaml says
peft.method=qlora, as `jaxllm convert import --peft ... peft.method=qlora` writes one): what
starts another run from it is the same as for a QLoRA-trained one, without a second compile."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_faults import tree_hash

import jaxllm
from jaxllm import adapters, checkpoint, config, sharding
from jaxllm.cli import main
from jaxllm.load import load_weights, restore
from jaxllm.model import abstract_model, merge_model
from jaxllm.train.state import init_state_from, layout

MODEL = [
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "model.vocab_size=320",
    "model.max_seq_len=64",
    "model.dtype=float32",
]
COMMON = [
    *MODEL,
    "train.global_batch_size=8",
    "train.sample_tokens=0",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "optim.warmup_steps=0",
    "checkpoint.save_final=true",
    "mesh.data=1",
    "mesh.fsdp=-1",
]
LORA = ["peft.method=lora", "peft.rank=4", "peft.alpha=8", "peft.targets=[all-linear]"]


def lowercase_share(prompts, completions, answers):
    """GRPO's reward here: the share of lowercase letters."""
    return [sum(ch.islower() for ch in c) / max(len(c), 1) for c in completions]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """data.sources of each format: chats for SFT, pairs for DPO, prompts for GRPO."""
    tmp = tmp_path_factory.mktemp("data")
    records = {
        "chat": [
            {
                "messages": [
                    {"role": "user", "content": f"{i % 5}+{i % 5}"},
                    {"role": "assistant", "content": f"{2 * (i % 5)}"},
                ]
            }
            for i in range(24)
        ],
        "preference": [
            {"prompt": f"q{i % 7}:", "chosen": " yes", "rejected": " no"} for i in range(32)
        ],
        "rollout": [{"prompt": f"q{i}:", "answer": ""} for i in range(8)],
    }
    out = {}
    for fmt, rows in records.items():
        path = tmp / f"{fmt}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[fmt] = f"[{{path: {path}, format: {fmt}}}]"
    return out


def sft_args(data, run) -> list[str]:
    sources = [f"data.sources={data['chat']}", f"data.eval_sources={data['chat']}"]
    return [*COMMON, *sources, "data.seq_len=64", "train.objective=sft", f"run.dir={run}"]


def dpo_args(data, run, init_from) -> list[str]:
    sources = [f"data.sources={data['preference']}", f"data.eval_sources={data['preference']}"]
    return [*COMMON, *sources, "data.seq_len=32", "train.objective=dpo", "train.beta=0.5"] + [
        f"checkpoint.init_from={init_from}",
        f"run.dir={run}",
    ]


def grpo_args(data, run, init_from) -> list[str]:
    return [
        *COMMON,
        f"data.sources={data['rollout']}",
        "data.eval_fraction=0",  # eight prompts: none held out
        "data.seq_len=24",
        "generate.kv_cache_dtype=float32",
        "train.objective=grpo",
        "train.global_batch_size=16",
        "train.num_generations=8",
        "train.max_completion_tokens=6",
        f"train.reward={__name__}:lowercase_share",
        "train.beta=0.1",
        f"checkpoint.init_from={init_from}",
        f"run.dir={run}",
    ]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_lora(tmp_path_factory, data) -> Path:
    run = tmp_path_factory.mktemp("sft_lora") / "run"
    assert main(["train", *sft_args(data, run), *LORA, "train.steps=2", "optim.lr=3e-2"]) == 0
    adapters_b = [x for k, x in _flat(restore(run, base=False).params) if k.endswith("_lora_b")]
    assert max(float(jnp.abs(b).max()) for b in adapters_b) > 0  # the SFT moved the model
    return run


def _peft_of(method: str) -> Callable[[Path], None]:
    """Makes a copy of the LoRA SFT run one of peft.method=`method` by its config.yaml (which
    is what reads it: a QLoRA run of its adapters, or for the refusals, runs of other
    methods)."""

    def setup(run: Path) -> None:
        text = (run / "config.yaml").read_text()
        (run / "config.yaml").write_text(text.replace("method: lora", f"method: {method}"))

    return setup


@pytest.fixture(scope="module")
def sft_qlora(tmp_path_factory, sft_lora) -> Path:
    run = tmp_path_factory.mktemp("sft_qlora") / "run"
    shutil.copytree(sft_lora, run)
    _peft_of("qlora")(run)
    return run


def _flat(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [("/".join(str(k.key) for k in path), x) for path, x in flat]


def _logits(model) -> np.ndarray:
    tokens = jnp.asarray(np.arange(24, dtype=np.int32).reshape(2, 12) * 7 % 320)
    return np.asarray(model(tokens).logits)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_a_fine_tuning_run_starts_a_run_as_the_model_it_trained(method, request, tmp_path):
    """Merged (no peft, or new adapters on it) and continued (its base and adapters), the
    starting model computes the fine-tuned run's logits; continuing keeps its base record."""
    source = request.getfixturevalue(f"sft_{method}")
    want = _logits(jaxllm.load_model(source))
    cfg = config.load(source / "config.yaml")
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    params, _ = load_weights(source, cfg.model, mesh)  # merged, NF4 dequantized
    merged = nnx.merge(abstract_model(cfg.model)[0], params)
    np.testing.assert_allclose(_logits(merged), want, atol=1e-5)

    overrides = [f"checkpoint.init_from={source}", "checkpoint.init_adapters=continue"]
    cont = config.load(source / "config.yaml", [*overrides, f"run.dir={tmp_path / 'run'}"])
    base = adapters.base_record(cont)
    ckpt_dir = source / "checkpoints"
    assert base == checkpoint.read_json_item(ckpt_dir, checkpoint.steps(ckpt_dir)[-1], "base")
    assert base == {"seed": 0}
    start = adapters.starting_weights(cont, str(source), mesh, base, tmp_path / "ckpt")
    state = init_state_from(
        start.params,
        cont.model,
        optax.sgd(0.0),
        mesh,
        cont.run.seed,
        start.model_state,
        adapters=start.adapters,
        **layout(cont),
    )
    graphdef = abstract_model(cont.model, cont.peft)[0]
    model = merge_model(graphdef, state.params, state.frozen, state.model_state)
    np.testing.assert_array_equal(_logits(model), want)


@dataclasses.dataclass
class Case:
    id: str
    argv: Callable[[dict, Path, Path], list[str]]  # (data, source run, new run) -> command line
    code: int
    says: str = ""  # a fragment of the one message line (exit 2)
    setup: Callable[[Path], None] | None = None  # edits the copy of the source run
    check: Callable[[Path], None] | None = None  # the new run (exit 0)


def _starts_at_the_reference(run: Path) -> None:
    """DPO's first step: the policy is the reference (both the SFT model)."""
    first = metrics(run)[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)


def _continues(run: Path) -> None:
    """A continued run: the SFT run's base, and a reference of its adapters alone."""
    _starts_at_the_reference(run)
    step = checkpoint.steps(run / "checkpoints")[-1]
    assert checkpoint.read_json_item(run / "checkpoints", step, "base") == {"seed": 0}
    held = checkpoint.read_json_item(run / "checkpoints", step, "others")
    assert held["reference"]["source"].endswith("source/checkpoints/2")


CONTINUE = "checkpoint.init_adapters=continue"
CASES = [
    # "no checkpoint ... is readable" before; the merged model now
    Case(
        "dpo-full-from-lora-sft",
        lambda d, s, r: [*dpo_args(d, r, s), "train.steps=1"],
        0,
        check=_starts_at_the_reference,
    ),
    Case(
        "dpo-full-from-qlora-sft",
        lambda d, s, r: [*dpo_args(d, r, s), "train.steps=1"],
        0,
        setup=_peft_of("qlora"),
        check=_starts_at_the_reference,
    ),
    Case(
        "dpo-lora-continuing-lora-sft",
        lambda d, s, r: [*dpo_args(d, r, s), *LORA, CONTINUE, "train.steps=1"],
        0,
        check=_continues,
    ),
    Case(
        "continue-other-rank",
        lambda d, s, r: [*dpo_args(d, r, s), *LORA, "peft.rank=8", CONTINUE],
        2,
        "has peft.rank=4, where this run has peft.rank=8",
    ),
    Case(
        "continue-other-targets",
        lambda d, s, r: [*dpo_args(d, r, s), *LORA, "peft.targets=[q_proj, v_proj]", CONTINUE],
        2,
        "peft.targets=[all-linear], where this run has peft.targets=[q_proj, v_proj]",
    ),
    Case(
        "continue-without-peft",
        lambda d, s, r: [*dpo_args(d, r, s), CONTINUE],
        2,
        "checkpoint.init_adapters=continue trains on the adapters",
    ),
    Case(
        "continue-a-full-run",
        lambda d, s, r: [*dpo_args(d, r, s), *LORA, CONTINUE],
        2,
        "is a full run (peft.method=none)",
        setup=_peft_of("none"),
    ),
    Case(
        "merge-a-prompt-run",
        lambda d, s, r: dpo_args(d, r, s),
        2,
        "is a prompt-tuning run (peft.method=prompt), whose soft prompt merges into no weight",
        setup=_peft_of("prompt"),
    ),
    Case(
        "continue-a-prompt-run-with-lora",
        lambda d, s, r: [*dpo_args(d, r, s), *LORA, CONTINUE],
        2,
        "has peft.method=prompt, where this run has peft.method=lora",
        setup=_peft_of("prompt"),
    ),
]


# slow: the same DPO run as the LoRA row; QLoRA's merged and continued starts run by default above
SLOW = {"dpo-full-from-qlora-sft"}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.id in SLOW else []) for c in CASES],
)
def test_init_from_a_fine_tuning_run(case: Case, data, sft_lora, tmp_path, capsys):
    source = tmp_path / "source"
    shutil.copytree(sft_lora, source)
    if case.setup:
        case.setup(source)
    before = tree_hash(source)
    run = tmp_path / "run"
    code = main(["train", *case.argv(data, source, run)])
    out, err = capsys.readouterr()
    messages = [ln for ln in err.splitlines() if ln.startswith("jaxllm:")]
    assert code == case.code, err
    assert "Traceback" not in out + err
    assert tree_hash(source) == before, "the command changed the source run"
    if case.code:
        assert len(messages) == 1, err
        assert case.says in messages[0], messages[0]
        assert not run.exists(), "a refused run left a directory behind"
    else:
        assert not messages, err
        case.check(run)


@pytest.mark.slow  # GRPO's rollouts compile a generator; DPO from LoRA runs by default above
def test_sft_lora_then_dpo_then_grpo_then_export(data, sft_lora, tmp_path):
    """SFT with LoRA; DPO with new adapters on its merged model (the default); GRPO going on
    with DPO's adapters (`continue`), its KL at the start 0 because the reference is the
    starting model; the end exported merged as a Hugging Face model with the run's logits."""
    dpo = tmp_path / "dpo"
    assert main(["train", *dpo_args(data, dpo, sft_lora), *LORA, "train.steps=2"]) == 0
    _starts_at_the_reference(dpo)
    step = checkpoint.steps(sft_lora / "checkpoints")[-1]
    base = checkpoint.read_json_item(dpo / "checkpoints", 2, "base")
    assert base["source"] == str((sft_lora / "checkpoints" / str(step)).resolve())
    assert main(["eval", str(dpo)]) == 0

    grpo = tmp_path / "grpo"
    args = [*grpo_args(data, grpo, dpo), *LORA, CONTINUE, "optim.lr=1e-2", "train.steps=2"]
    assert main(["train", *args]) == 0
    first, last = metrics(grpo)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)
    assert last["kl"] > 0
    assert checkpoint.read_json_item(grpo / "checkpoints", 2, "base") == base  # DPO's base

    hf = tmp_path / "hf"
    assert main(["convert", "export", str(grpo), str(hf), "--merge"]) == 0
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()
    want = _logits(jaxllm.load_model(grpo))
    np.testing.assert_allclose(_logits(jaxllm.load_model(hf)), want, atol=1e-5)
