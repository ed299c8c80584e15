"""`jaxllm serve` as lm-evaluation-harness's `local-completions` backend: on a task YAML over a
local JSONL file, lm-eval's OpenAI-completions client (the run's exported Hugging Face tokenizer
on its side, `echo` with `logprobs: 1` on the wire) scores a served tiny run as the `jaxllm`
model type scores the run itself, choice by choice, and whole documents by rolling windows. The
server compiled its prompt log-probabilities programs first (`precompile_scoring`): scoring
meets no other. Nothing downloads."""

import numpy as np
import pytest
from test_harness import ROLLING_TASK, SENTENCES, _evaluate, _jsonl, _responses
from test_serve import in_thread

from jaxllm.infer.engine import runner
from jaxllm.serve.cli import build, load

MC_TASK = """\
task: served_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(run, exported HF directory, task directory), with the harness kept offline."""
    from conftest import TINY_RUN
    from hf_models import run_cli

    from jaxllm.data import train_bpe

    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("served")
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.setenv(key, "1")
    mp.setenv("HF_DATASETS_CACHE", str(root / "datasets-cache"))
    corpus = [{"text": " ".join(SENTENCES[i:] + SENTENCES[:i])} for i in range(5)] * 8
    data = _jsonl(root / "corpus.jsonl", corpus)
    bpe = train_bpe([r["text"] for r in corpus], 300, root / "bpe")
    run, hf = root / "run", root / "hf"
    train = [*TINY_RUN, "model.max_seq_len=64", f"data.tokenizer={bpe}", "train.steps=8"]
    train += [f"data.sources=[{{path: {data}}}]", "data.eval_fraction=0", f"run.dir={run}"]
    assert run_cli("train", *train) == 0
    assert run_cli("convert", "export", run, hf) == 0
    tasks = root / "tasks"
    tasks.mkdir()
    mc = [
        {"question": s.rsplit(" ", 1)[0], "choices": [" mat.", " park.", " tree."], "answer": i % 3}
        for i, s in enumerate(SENTENCES)
    ]
    rolling = [{"text": " ".join(SENTENCES * 6)}, {"text": SENTENCES[0]}]  # several windows
    for name, template, rows in (("mc", MC_TASK, mc), ("rolling", ROLLING_TASK, rolling)):
        path = _jsonl(tasks / f"{name}.jsonl", rows)
        (tasks / f"{name}.yaml").write_text(template.format(data=path))
    yield run, hf, tasks
    mp.undo()


@pytest.mark.slow  # a run trained and exported, a server compiled, lm-eval twice: ~1 minute
def test_local_completions_scores_as_the_jaxllm_model_type(setup):
    run, hf, tasks = setup
    names = ["served_mc", "tiny_rolling"]
    model, tok, stops, bos = load(run)
    kw = dict(max_num_seqs=4, page_size=8, chunk_size=16)
    app, worker = build(model, tok, stops, bos, "tiny", precompile_scoring=True, **kw)
    with in_thread(app) as url:
        traces = runner.TRACES[0]
        args = f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface"
        args += f",tokenizer={hf},max_length=64,add_bos_token={bool(bos)}"
        served = _evaluate("local-completions", args, tasks, names)
        assert runner.TRACES[0] == traces  # the precompiled programs were all it met
    # the client's rolling windows: its max_length less one kept for a generated token and one
    # for the context; the model type's are its max_length
    ours = _evaluate("jaxllm", f"run={run},max_length=62", tasks, names)
    got, want = (_responses(r, "served_mc") for r in (served, ours))
    assert len(got) == len(SENTENCES)
    for g, w in zip(got, want):  # each choice: (log-likelihood, is greedy)
        np.testing.assert_allclose([x[0] for x in g], [x[0] for x in w], atol=1e-4, rtol=0)
        assert [x[1] for x in g] == [x[1] for x in w]
    got, want = (_responses(r, "tiny_rolling") for r in (served, ours))
    np.testing.assert_allclose(np.ravel(got), np.ravel(want), atol=1e-3, rtol=0)
    assert worker.engine.pool.num_used == 0
