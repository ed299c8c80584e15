"""One file is a dataset: a source with too few files for `data.eval_fraction` holds out records
(by a hash of file key and record index, stable under appends) in every format, multi-file
sources keep their file split, `data.eval_fraction=0` trains without evaluation, and an eval
split's last part-batch (all of a split smaller than a batch) is padded, and no objective counts
the padding."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data import pipeline, preference, rollout, sft
from jaxllm.data.prepare import prepare
from jaxllm.data.sources import list_files
from jaxllm.data.split import TEXT_RECORD_LINES, held_out
from jaxllm.data.tokenizer import make_tokenizer

# ------------------------------------------------------------------------- the split rule


def _records(fmt: str, start: int, stop: int) -> list:
    """Records start .. stop - 1 of a file of format `fmt`, each unique."""
    if fmt in ("jsonl", "parquet", "arrayrecord"):
        return [{"text": f"document {i} " * 3} for i in range(start, stop)]
    if fmt == "chat":
        return [
            {
                "messages": [
                    {"role": "user", "content": f"q{i}"},
                    {"role": "assistant", "content": f"a{i}"},
                ]
            }
            for i in range(start, stop)
        ]
    if fmt == "prompt_completion":
        return [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(start, stop)]
    if fmt == "rollout":
        return [{"prompt": f"q{i}=", "answer": f"a{i}"} for i in range(start, stop)]
    assert fmt == "preference"
    return [
        {"prompt": f"q{i}", "chosen": f" y{i}", "rejected": f" n{i}"} for i in range(start, stop)
    ]


def _write(path, fmt: str, records: list) -> None:
    if fmt == "parquet":
        pq.write_table(pa.table({"text": [r["text"] for r in records]}), path)
    elif fmt == "arrayrecord":
        writer = ArrayRecordWriter(str(path), "group_size:1")
        for r in records:
            writer.write(r["text"].encode())
        writer.close()
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _seqs(docs) -> list[tuple]:
    """The documents `_source_documents` returns, as comparable tuples of ids."""
    if isinstance(docs, sft.Examples):
        return [tuple(t.tolist()) for t in docs.tokens]
    if isinstance(docs, preference.Pairs):
        return [
            tuple(c.tolist()) + (-1,) + tuple(r.tolist())
            for (c, _), (r, _) in zip(docs.chosen, docs.rejected)
        ]
    return [tuple(np.asarray(d).tolist()) for d in docs]


def _split(path, fmt: str, fraction: float = 0.2):
    src = SourceConfig(path=str(path), format=fmt)
    cfg = DataConfig(sources=(src,), seq_len=32, eval_fraction=fraction)
    if fmt == "rollout":  # prompts, read by the rollouts rather than the pipeline
        train, held = rollout.prompt_splits(cfg, make_tokenizer(cfg))
        return [(p.prompt, p.answer) for p in train], [(p.prompt, p.answer) for p in held]
    train, held = pipeline._source_documents(src, "data.sources[0]", cfg, make_tokenizer(cfg), True)
    return _seqs(train), _seqs(held)


SUFFIX = {"parquet": ".parquet", "arrayrecord": ".arrayrecord"}


@pytest.mark.parametrize(
    "fmt", ["jsonl", "parquet", "arrayrecord", "chat", "prompt_completion", "preference", "rollout"]
)
def test_one_file_holds_out_records_stable_under_appends(tmp_path, fmt):
    path = tmp_path / f"data{SUFFIX.get(fmt, '.jsonl')}"
    _write(path, fmt, _records(fmt, 0, 60))
    train, held = _split(path, fmt)
    assert len(train) + len(held) == 60 and 3 <= len(held) <= 25
    assert not set(train) & set(held)
    _write(path, fmt, _records(fmt, 0, 90))  # records appended: the first 60 keep their side
    train2, held2 = _split(path, fmt)
    assert train2[: len(train)] == train and held2[: len(held)] == held
    assert len(train2) + len(held2) == 90


def test_one_text_file_holds_out_blocks_of_lines(tmp_path):
    path = tmp_path / "book.txt"
    lines = [f"line {i}\n" for i in range(30 * TEXT_RECORD_LINES)]
    path.write_text("".join(lines))

    def sides(fraction=0.2):
        src = SourceConfig(path=str(path))
        cfg = DataConfig(sources=(src,), seq_len=32, eval_fraction=fraction, tokenizer="byte")
        tok = make_tokenizer(cfg)
        docs = pipeline._source_documents(src, "data.sources[0]", cfg, tok, True)
        return [{ln for d in side for ln in tok.decode(d).splitlines()} for side in docs]

    train, held = sides()
    assert train and held and not train & held and len(train | held) == len(lines)
    path.write_text("".join(lines) + "".join(f"more {i}\n" for i in range(500)))
    train2, held2 = sides()
    assert train <= train2 and held <= held2
    path.write_text("".join(lines))  # the data line counts the blocks held out, not their runs
    cfg = DataConfig(sources=(SourceConfig(path=str(path)),), seq_len=32, eval_fraction=0.2)
    train_rows, eval_rows = pipeline.load_splits(cfg)
    assert train_rows.num_docs + eval_rows.num_docs == 30 and eval_rows.num_docs > 1


def test_multi_file_sources_keep_their_file_split(tmp_path):
    # pinned: these 20 files at eval_fraction=0.2 held out these 5 files before records could be
    for i in range(20):
        (tmp_path / f"f{i:02d}.jsonl").write_text(json.dumps({"text": f"file {i}"}) + "\n")
    files = list_files(SourceConfig(path=str(tmp_path)), "data.sources[0]")
    assert [f.key for f in files if held_out(f.key, 0.2)] == PINNED
    train, held = _split(tmp_path, "jsonl")
    tok = make_tokenizer(DataConfig())
    held_files = sorted(tok.decode(np.asarray(d)) for d in held)
    assert held_files == sorted(f"file {int(k[1:3])}" for k in PINNED)
    assert len(train) == 20 - len(PINNED)


PINNED = ["f01.jsonl", "f02.jsonl", "f09.jsonl", "f15.jsonl", "f16.jsonl"]


def test_too_few_records_is_one_config_error(tmp_path):
    path = tmp_path / "two.jsonl"
    _write(path, "jsonl", _records("jsonl", 0, 2))
    with pytest.raises(ConfigError, match="leaves .* records of the 1 file"):
        _split(path, "jsonl", 0.05)
    book = tmp_path / "book.txt"  # 3 records: blocks of 100 lines, none held out at 0.001
    book.write_text("".join(f"line {i}\n" for i in range(250)))
    with pytest.raises(ConfigError) as e:
        _split(book, "text", 0.001)
    assert "leaves 3 train and 0 eval records (a text file's are blocks of 100 lines)" in str(
        e.value
    )
    assert str(e.value).endswith("or train without evaluation: data.eval_fraction=0.")


def test_a_prepared_file_splits_as_training_splits_it(tmp_path):
    path = tmp_path / "data.jsonl"
    _write(path, "jsonl", _records("jsonl", 0, 60))
    manifest = prepare([SourceConfig(path=str(path))], tmp_path / "prep", eval_fraction=0.2)
    assert manifest["splits"]["eval"]["docs"] > 0
    assert _split(tmp_path / "prep", "auto") == _split(path, "jsonl")


# ------------------------------------------------------------------------- no held-out split


def test_eval_fraction_0_trains_without_evaluation(tmp_path, capsys):
    from conftest import SMALL_RUN

    from jaxllm.cli import main

    run = tmp_path / "run"
    args = [*SMALL_RUN, "data.eval_fraction=0", "train.eval_every=1", "train.steps=2"]
    assert main(["train", *args, f"run.dir={run}"]) == 0
    err = capsys.readouterr().err
    assert "no held-out split" in err and "train.eval_every does nothing" in err
    assert "no eval: no held-out split (data.eval_fraction=0)" in err.splitlines()[-1]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and not [k for r in rows for k in r if k.startswith("eval_")]
    # `jaxllm eval` of that run has nothing to evaluate unless told what: one config error
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "jaxllm: config error:" in err and "eval_sources" in err


# ------------------------------------------------------------------------- a split under a batch

TINY = [
    "model.vocab_size=320",
    "model.d_model=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "model.max_seq_len=64",
    "model.dtype=float32",
    "data.seq_len=32",
    "train.global_batch_size=16",
    "train.eval_batches=1",
    "mesh.data=1",
    "mesh.fsdp=1",
]
ENCODER = [  # a BERT-shaped encoder (tests/test_mlm.py)
    "model.kind=encoder",
    "model.position=learned",
    "model.norm=layernorm",
    "model.tie_embeddings=true",
    "model.encoder.mlm_head=true",
    "model.mlp_activation=gelu",
]
OBJECTIVES = {  # objective -> (source format, more overrides)
    "next_token": ("jsonl", []),
    "sft": ("prompt_completion", ["train.objective=sft"]),
    "prefix_lm": ("jsonl", ["train.objective=prefix_lm"]),
    "mlm": ("jsonl", [*ENCODER, "train.objective=mlm"]),
    "span_corruption": (
        "jsonl",
        [
            "train.objective=span_corruption",
            "model.kind=encoder_decoder",
            "model.position=relative",
        ],
    ),
    "dpo": ("preference", ["train.objective=dpo"]),  # + train.reference, as distill's teacher
    "ipo": ("preference", ["train.objective=ipo"]),
    "simpo": ("preference", ["train.objective=simpo"]),
    "orpo": ("preference", ["train.objective=orpo"]),
    "reward": ("preference", ["train.objective=reward", "model.head=score"]),
    "distill": ("jsonl", ["train.objective=distill"]),
}
WITH_OTHER = {"dpo": "train.reference", "ipo": "train.reference", "distill": "train.teacher"}


@pytest.fixture(scope="module")
def other_run(tmp_path_factory):
    """A run directory holding a weights-only checkpoint of a tiny decoder: the reference of
    DPO / IPO, the teacher of distillation."""
    from jaxllm import checkpoint, config
    from jaxllm.model import build, split_peft

    cfg = config.load(None, TINY)
    path = tmp_path_factory.mktemp("other") / "run"
    path.mkdir()
    config.dump(cfg, path / "config.yaml")
    checkpoint.save_params(
        checkpoint.checkpoint_dir(path, cfg.checkpoint.dir),
        split_peft(build(cfg.model, 3), None)[1],
        step=0,
        config=config.to_dict(cfg),
        tokenizer=checkpoint.tokenizer_record(cfg.data.tokenizer),
    )
    return path


def _eval_of_five(tmp_path, name: str, *more: str):
    """(the eval loss of a 5-row eval split, padded to a batch of 16, through `evaluate`; the
    mean over those 5 rows computed directly, one row at a time)."""
    import jax

    from jaxllm import config, objectives, sharding
    from jaxllm.data.objective_rows import row_transform
    from jaxllm.data.span_corruption import corrupted_splits
    from jaxllm.sharding import to_global
    from jaxllm.train import companions
    from jaxllm.train.compiled import compile_steps, evaluate
    from jaxllm.train.state import init_state, layout

    fmt, overrides = OBJECTIVES[name]
    path = tmp_path / f"{name}.jsonl"
    _write(path, fmt, _records(fmt, 0, 40))
    source = f"[{{path: {path}, format: {fmt}}}]"
    args = [*TINY, *overrides, f"data.sources={source}", f"data.eval_sources={source}", *more]
    cfg = config.load(None, args).validate(1)
    if name == "span_corruption":
        _, rows = corrupted_splits(cfg.data, cfg.model.vocab_size)
    else:
        _, rows = pipeline.load_splits(cfg.data, whole_inputs=name == "reward")
    five = [rows[i] for i in range(5)]  # the eval split: 5 rows, a third of a batch
    rewrite = row_transform(cfg, make_tokenizer(cfg.data))
    batches = pipeline.eval_batches(five, 16, 1, None, rewrite)
    assert len(batches) == 1 and len(batches[0]["inputs"]) == 16

    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    _, jit_eval, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, 0, **layout(cfg))
    held = companions.resolve_others(cfg, objectives.from_config(cfg))
    state = state.replace(others=companions.load(held, mesh))
    weights = (state.model_state, state.frozen, state.others)
    padded = evaluate(jit_eval, state.params, batches, batch_sh, *weights)["eval_loss"]
    loss = tokens = 0.0
    for i, row in enumerate(five):
        one = {k: v[None] for k, v in (rewrite(i, row) if rewrite else row).items()}
        sums = jit_eval(state.params, to_global(one, batch_sh, 1), *weights)
        loss, tokens = loss + float(sums["loss"]), tokens + float(sums["tokens"])
    assert tokens > 0
    return padded, loss / tokens


FAST = ["next_token", "sft", "orpo", "reward"]  # the rest (~50 s) are marked slow


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in OBJECTIVES]
)
def test_an_eval_split_under_a_batch_is_the_mean_over_its_rows(tmp_path, name, request):
    more = (
        [f"{WITH_OTHER[name]}={request.getfixturevalue('other_run')}"] if name in WITH_OTHER else []
    )
    padded, direct = _eval_of_five(tmp_path, name, *more)
    assert padded == pytest.approx(direct, rel=1e-5)


def test_an_eval_reads_every_row_of_a_split_larger_than_a_batch():
    rows = [{"inputs": np.full(4, i + 1), "loss_mask": np.ones(4, np.float32)} for i in range(21)]
    batches = pipeline.eval_batches(rows, 8, 100)  # 2 batches and 5 rows
    assert np.concatenate([b["inputs"][:, 0] for b in batches]).tolist() == [*range(1, 22), 0, 0, 0]
    assert batches[-1]["loss_mask"].sum(axis=1).tolist() == [4] * 5 + [0] * 3
    halves = [pipeline.eval_batches(rows, 8, 100, local) for local in (slice(0, 4), slice(4, 8))]
    for whole, a, b in zip(batches, *halves, strict=True):  # each process: its rows of each batch
        assert np.array_equal(np.concatenate([a["inputs"], b["inputs"]]), whole["inputs"])
    assert len(pipeline.eval_batches(rows, 8, 2)) == 2  # num_batches still bounds it


def test_jaxllm_eval_evaluates_a_split_under_a_batch(other_run, tmp_path):
    from jaxllm.evaluate import evaluate_checkpoint

    path = tmp_path / "valid.jsonl"  # 3 short examples: 1 row of 32, not a batch of 16
    _write(path, "prompt_completion", _records("prompt_completion", 0, 3))
    source = f"[{{path: {path}, format: prompt_completion}}]"
    out = evaluate_checkpoint(other_run, ["mesh.fsdp=-1", f"data.eval_sources={source}"])
    assert np.isfinite(out["eval_loss"]) and out["tokens"] == 32
    assert (out["rows_read"], out["rows"]) == (1, 1)


def test_jaxllm_eval_says_how_much_of_the_split_it_read():
    from jaxllm.evaluate import summary

    r = {"step": 9, "eval_loss": 1.0, "perplexity": 2.718}
    whole = summary({**r, "tokens": 320, "rows_read": 10, "rows": 10})
    assert whole.endswith("(320 tokens, 10 rows)")
    part = summary({**r, "tokens": 256, "rows_read": 8, "rows": 6597})
    assert part.endswith("(256 tokens, 8 rows of 6,597; --batches N reads more)")
    tail = summary({**r, "tokens": 256, "rows_read": 8, "rows": 10})  # a part-batch left
    assert tail.endswith("(256 tokens, 8 rows of 10; --batches N reads more)")


@pytest.mark.slow  # ~20 s: a DPO train step
def test_precomputed_reference_without_a_held_out_split(other_run, tmp_path):
    from jaxllm import config
    from jaxllm.train.loop import train

    path = tmp_path / "pairs.jsonl"
    _write(path, "preference", _records("preference", 0, 40))
    args = [*TINY, "mesh.fsdp=-1", "train.objective=dpo", f"train.reference={other_run}"]
    args += ["train.precompute_reference=true", "data.eval_fraction=0", "train.steps=2"]
    args += [f"data.sources=[{{path: {path}, format: preference}}]", f"run.dir={tmp_path / 'run'}"]
    result = train(config.load(None, args))
    assert result["step"] == 2 and np.isfinite(result["loss"])
    assert not [k for k in result if k.startswith("eval_")]
