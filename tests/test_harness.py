"""The `jaxllm` model type of EleutherAI's lm-evaluation-harness: on task YAMLs over local JSONL
files, a tiny trained run scores as the harness's Hugging Face backend scores its export
(`jaxllm convert export`), request by request: multiple-choice log-likelihoods, rolling
log-likelihoods over several windows, and greedy generation with `until` and max_gen_toks.
Nothing downloads."""

import json
import os
import re
import subprocess
import sys

import lm_eval
import numpy as np
import pytest
import torch
from conftest import TINY_RUN, cpu_env
from hf_models import run_cli, stderr_of_failure

SENTENCES = [
    "the cat sat on the mat.",
    "the dog ran to the park.",
    "a bird sang in the tree.",
    "the sun is hot and bright.",
    "one plus one is two.",
]

MC_TASK = """\
task: tiny_mc
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
  - metric: acc_norm
"""

GEN_TASK = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""

ROLLING_TASK = """\
task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(run, exported HF directory, task directory), with the harness kept offline."""
    from jaxllm.data import train_bpe

    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("harness")
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.setenv(key, "1")
    mp.setenv("HF_DATASETS_CACHE", str(root / "datasets-cache"))
    corpus = [{"text": " ".join(SENTENCES[i:] + SENTENCES[:i])} for i in range(5)] * 8
    data = _jsonl(root / "corpus.jsonl", corpus)
    bpe = train_bpe([r["text"] for r in corpus], 300, root / "bpe")
    run, hf = root / "run", root / "hf"
    train = [*TINY_RUN, "model.max_seq_len=64", f"data.tokenizer={bpe}", "train.steps=40"]
    train += [f"data.sources=[{{path: {data}}}]", "data.eval_fraction=0", f"run.dir={run}"]
    assert run_cli("train", *train) == 0
    assert run_cli("convert", "export", run, hf) == 0
    tasks = root / "tasks"
    tasks.mkdir()
    mc = [
        {"question": s.rsplit(" ", 1)[0], "choices": [" mat.", " park.", " tree."], "answer": i % 3}
        for i, s in enumerate(SENTENCES)
    ]
    gen = [
        {"prompt": s.split(" ", 2)[0] + " " + s.split(" ", 2)[1], "answer": ""} for s in SENTENCES
    ]
    gen += [{"prompt": "the cat sat", "answer": " on the mat"}]
    long_doc = " ".join(SENTENCES * 6)  # longer than max_seq_len: several windows
    rolling = [{"text": long_doc}, {"text": SENTENCES[0]}, {"text": "zebra quantum fox"}]
    for name, template, rows in (
        ("mc", MC_TASK, mc),
        ("gen", GEN_TASK, gen),
        ("rolling", ROLLING_TASK, rolling),
    ):
        path = _jsonl(tasks / f"{name}.jsonl", rows)
        (tasks / f"{name}.yaml").write_text(template.format(data=path))
    torch.set_num_threads(1)
    yield run, hf, tasks
    mp.undo()


def _evaluate(model, model_args, tasks, names):
    from lm_eval.tasks import TaskManager

    import jaxllm.harness  # noqa: F401  (registers `jaxllm`)

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=names,
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        batch_size=4,
    )


def _responses(result, task):
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [s["filtered_resps"] for s in samples]


@pytest.fixture(scope="module")
def both(setup):
    run, hf, tasks = setup
    names = ["tiny_mc", "tiny_gen", "tiny_rolling"]
    ours = _evaluate("jaxllm", f"run={run}", tasks, names)
    theirs = _evaluate("hf", f"pretrained={hf},dtype=float32,device=cpu", tasks, names)
    return ours, theirs


def test_loglikelihood_scores_equal_the_hf_backend(both):
    ours, theirs = both
    got, want = (_responses(r, "tiny_mc") for r in both)
    assert len(got) == len(SENTENCES)
    for g, w in zip(got, want):  # each choice: (log-likelihood, is greedy)
        np.testing.assert_allclose([x[0] for x in g], [x[0] for x in w], atol=1e-4, rtol=0)
        assert [x[1] for x in g] == [x[1] for x in w]
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == theirs["results"]["tiny_mc"][metric]


def test_rolling_loglikelihood_equals_the_hf_backend(both):
    got, want = (_responses(r, "tiny_rolling") for r in both)
    np.testing.assert_allclose(np.ravel(got), np.ravel(want), atol=1e-4, rtol=0)
    assert np.ravel(got)[0] < np.ravel(got)[1] < 0  # the long document has the most tokens
    ours, theirs = (r["results"]["tiny_rolling"] for r in both)
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        np.testing.assert_allclose(ours[metric], theirs[metric], rtol=1e-4)


def test_greedy_generation_equals_the_hf_backend(both):
    ours, theirs = both
    got, want = (_responses(r, "tiny_gen") for r in both)
    assert got == want
    assert any(g[0].strip() for g in got) and not any("." in g[0] for g in got)  # cut at until
    assert (
        ours["results"]["tiny_gen"]["exact_match,none"]
        == (theirs["results"]["tiny_gen"]["exact_match,none"])
    )


def test_jaxllm_eval_harness_prints_the_table(setup, both, capsys):
    run, _, tasks = setup
    assert run_cli("eval", run, "--harness", "tiny_mc", "--include-path", tasks) == 0
    out = capsys.readouterr().out
    row = re.search(r"\|acc\s*\|[^|]*\|\s*([0-9.]+)\|", out)
    assert "tiny_mc" in out and row, out
    assert float(row.group(1)) == pytest.approx(both[0]["results"]["tiny_mc"]["acc,none"])


def test_bad_runs_tasks_and_options_are_one_line(setup, capsys, tmp_path):
    run, _, tasks = setup
    err = stderr_of_failure(capsys, "eval", tmp_path, "--harness", "tiny_mc")
    assert err.startswith("jaxllm: ") and err.count("\n") == 1
    err = stderr_of_failure(
        capsys, "eval", run, "--harness", "no_such_task", "--include-path", tasks
    )
    assert "no_such_task" in err and err.count("\n") == 1
    err = stderr_of_failure(capsys, "eval", run, "--limit", "3")
    assert "--harness" in err and err.count("\n") == 1


def test_lm_eval_command_line_refuses_a_directory_that_is_not_a_run(setup, tmp_path):
    _, _, tasks = setup
    argv = ["--model", "jaxllm", "--model_args", f"run={tmp_path}", "--tasks", "tiny_mc"]
    argv += ["--include_path", str(tasks)]
    p = subprocess.run(
        [sys.executable, "-m", "jaxllm.harness", *argv],
        capture_output=True,
        text=True,
        env=cpu_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"),
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith("jaxllm: ")
    assert "Traceback" not in p.stderr


HOOK_CHECK = """
import sys
import _jaxllm_lm_eval
_jaxllm_lm_eval.install()
assert not {"jax", "jaxllm", "lm_eval"} & set(sys.modules), sorted(sys.modules)
from lm_eval.api.registry import get_model, model_registry
get_model("hf")  # an empty registry still imports lm_eval's own table
assert model_registry._objs["jaxllm"] == "jaxllm.harness:JaxllmLM"
assert "jax" not in sys.modules  # registered lazily: nothing heavy loads until it is used
print(get_model("jaxllm").__module__)
"""


def test_the_start_up_hook_registers_jaxllm_lazily_when_lm_eval_loads_its_models():
    p = subprocess.run(
        [sys.executable, "-c", HOOK_CHECK], capture_output=True, text=True, env=cpu_env()
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["jaxllm.harness"]


@pytest.mark.slow  # a process that loads jax and the harness and compiles: about a minute
def test_the_lm_eval_command_scores_as_jaxllm_eval_harness(setup, both, tmp_path):
    """`lm_eval --model jaxllm`, the harness's own console script of this environment, with
    nothing imported first: the installed `jaxllm_lm_eval.pth` registers the model type."""
    run, _, tasks = setup
    probe = "import sys; print(any(type(f).__module__ == '_jaxllm_lm_eval' for f in sys.meta_path))"
    hooked = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert hooked.stdout.strip() == "True", (
        "jaxllm_lm_eval.pth is not installed in this environment: pip install -e '.[test]' again"
    )
    script = os.path.join(os.path.dirname(sys.executable), "lm_eval")
    argv = ["--model", "jaxllm", "--model_args", f"run={run}", "--tasks", "tiny_mc"]
    argv += ["--include_path", str(tasks), "--batch_size", "4", "--log_samples"]
    argv += ["--output_path", str(tmp_path)]
    env = cpu_env(as_this_process=True, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets-cache")
    p = subprocess.run([script, *argv], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (results,) = tmp_path.rglob("results_*.json")
    (samples,) = tmp_path.rglob("samples_tiny_mc_*.jsonl")
    got = json.loads(results.read_text())["results"]["tiny_mc"]
    want = both[0]["results"]["tiny_mc"]
    for metric in ("acc,none", "acc_norm,none"):
        assert got[metric] == want[metric]
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    got = [
        [float(x[0]) for x in r["filtered_resps"]] for r in sorted(rows, key=lambda r: r["doc_id"])
    ]
    want = [[x[0] for x in r] for r in _responses(both[0], "tiny_mc")]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad", ["not_a_run", "unknown_model_arg"])
def test_the_lm_eval_command_refuses_a_bad_run_in_one_line(tmp_path, bad):
    """The bare `lm_eval` console script: lm_eval builds the model from `--model_args` and
    would print the constructor's traceback; a jaxllm ConfigError is one line and exit 2."""
    args = f"run={tmp_path}" if bad == "not_a_run" else f"run={tmp_path},dtype=float32"
    script = os.path.join(os.path.dirname(sys.executable), "lm_eval")
    argv = [script, "--model", "jaxllm", "--model_args", args, "--tasks", "arc_easy"]
    env = cpu_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxllm: config error: "), p.stderr[-3000:]
    assert ("is not a run directory" if bad == "not_a_run" else "dtype is not") in last
    assert "Traceback" not in p.stderr


def test_lm_eval_from_python_raises_the_config_error(tmp_path):
    """Outside lm_eval's command line the model type raises, as any jaxllm API does."""
    from lm_eval.api.registry import get_model

    from jaxllm.config import ConfigError
    from jaxllm.harness import JaxllmLM

    assert "lm_eval._cli" not in sys.modules
    assert get_model("jaxllm") is JaxllmLM
    with pytest.raises(ConfigError, match="is not a run directory"):
        JaxllmLM.create_from_arg_string(f"run={tmp_path}")
    with pytest.raises(ConfigError, match="is not a jaxllm model argument"):
        JaxllmLM.create_from_arg_obj({"run": str(tmp_path), "dtype": "float32"})
