"""stdlib-qa: definitions read with ast, questions and answers, the split by top-level object
(test questions about unseen objects), determinism, the chat format, `jaxllm data stdlib-qa`."""

import json

import pytest

from jaxllm.cli import main
from jaxllm.config import ConfigError, SourceConfig
from jaxllm.data import preference, sft, stdlib_qa
from jaxllm.data.sources import DataFile
from jaxllm.data.tokenizer import ByteTokenizer
from jaxllm.infer.chat import read_conversations

HEAP = """
def heappush(heap, item):
    pass
def heappop(heap, /, *rest, key=None, **kw):
    pass
async def merge(*iterables, key=None, reverse=False):
    pass
class Heap:
    def push(self, item: int = 0) -> None:
        pass
    def _hidden(self):
        pass
def nlargest(n, iterable, key=None, reverse=False, extra=1):
    pass
def _private(x):
    pass
def shared(x):
    pass
"""


@pytest.fixture
def root(tmp_path):
    """A tiny standard library: heap (6 public top-level names), pkg (1: too few to ask about),
    pkg.sub (4), a private module, a test package and a file that does not parse."""
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "test").mkdir()
    (lib / "heap.py").write_text(HEAP)
    (lib / "pkg/__init__.py").write_text("def shared(y):\n    pass\n")
    subs = (
        "".join(f"def sub{i}(a{i}):\n    pass\n" for i in range(3)) + "class SubError:\n    pass\n"
    )
    (lib / "pkg/sub.py").write_text(subs)
    (lib / "_hidden.py").write_text("def hidden_a(): pass\n" * 5)
    (lib / "test/test_heap.py").write_text(HEAP.replace("heap", "theap"))
    (lib / "broken.py").write_text("def oops(:\n")
    return lib


def test_definitions_are_the_public_functions_classes_and_methods(root):
    defs = {d.subject: d for d in stdlib_qa.definitions(root)}
    heap = ("heappush", "heappop", "merge", "Heap", "Heap.push", "nlargest", "shared")
    assert set(defs) == {
        *(f"heap.{n}" for n in heap),
        "pkg.shared",
        *(f"pkg.sub.sub{i}" for i in range(3)),
        "pkg.sub.SubError",
    }
    assert defs["heap.heappop"].params == ("heap", "*rest", "key", "**kw")
    assert defs["heap.heappop"].signature == "heap, /, *rest, key=None, **kw"
    assert defs["heap.merge"].params == ("*iterables", "key", "reverse")
    push = defs["heap.Heap.push"]
    assert (push.signature, push.params, push.top) == (
        "self, item=0",
        ("self", "item"),
        "heap.Heap",
    )
    assert defs["heap.Heap"].params is None


def test_questions_answers_and_the_split_by_object(root, tmp_path):
    info = stdlib_qa.write_stdlib_qa(tmp_path / "a", seed=0, test_fraction=0.4, root=root)
    rows = {
        name: [json.loads(line) for line in (tmp_path / f"a/{name}.jsonl").read_text().splitlines()]
        for name in ("train", "test")
    }
    every = rows["train"] + rows["test"]
    assert {r["messages"][1]["content"] for r in every if r["kind"] == "module"} == {
        "heap",
        "pkg.sub",
    }  # pkg has too few objects to be asked about
    assert info["modules"] == 2
    assert sum(sum(v.values()) for v in info["questions"].values()) == len(every)
    by_subject = {}
    for r in every:
        (user, assistant) = r["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        by_subject.setdefault(r["subject"], {})[r["kind"]] = (user["content"], assistant["content"])
        assert f"`{r['subject']}" in user["content"]
    question, answer = by_subject["heap.heappop"]["args"]
    assert "`heap.heappop(heap, /, *rest, key=None, **kw)`" in question
    assert answer == "heap, *rest, key, **kw"
    assert by_subject["heap.Heap.push"]["module"][1] == "heap"
    assert by_subject["heap.Heap.push"]["args"][1] == "self, item"
    assert set(by_subject["heap.Heap"]) == {"module"}
    assert "args" not in by_subject["heap.nlargest"]  # five arguments: too long an answer
    # held out by top-level object: a test class takes its methods along
    train_tops = {r["top"] for r in rows["train"]}
    assert rows["test"] and not train_tops & {r["top"] for r in rows["test"]}
    assert len({r["top"] for r in every if r["subject"].startswith("heap.Heap")}) == 1
    # deterministic; another seed draws another split or other phrasings
    stdlib_qa.write_stdlib_qa(tmp_path / "b", seed=0, test_fraction=0.4, root=root)
    stdlib_qa.write_stdlib_qa(tmp_path / "c", seed=1, test_fraction=0.4, root=root)
    for name in ("train.jsonl", "test.jsonl", "preference.jsonl", "info.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a/test.jsonl").read_bytes() != (tmp_path / "c/test.jsonl").read_bytes()
    one = stdlib_qa.write_stdlib_qa(tmp_path / "d", max_modules=1, test_fraction=0.4, root=root)
    assert one["modules"] == 1


def test_files_are_chat_sources_with_references(root, tmp_path):
    stdlib_qa.write_stdlib_qa(tmp_path, test_fraction=0.4, root=root)
    src = SourceConfig(path=str(tmp_path / "train.jsonl"), format="chat")
    f = DataFile(tmp_path / "train.jsonl", "chat", "train.jsonl")
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    examples = list(sft.read_examples(f, src, ByteTokenizer(), "fail"))
    assert len(examples) == len(lines)
    asked = read_conversations(tmp_path / "test.jsonl")
    answers = [json.loads(line)["messages"][1]["content"] for line in open(tmp_path / "test.jsonl")]
    assert [c.reference for c in asked] == answers
    assert all(len(c.messages) == 1 for c in asked)


def test_too_few_questions_or_bad_arguments_are_config_errors(root, tmp_path):
    with pytest.raises(ConfigError, match="too few for a train and a test split"):
        stdlib_qa.write_stdlib_qa(tmp_path, test_fraction=0.01, root=root)
    with pytest.raises(ConfigError, match="--test-fraction must be in"):
        stdlib_qa.write_stdlib_qa(tmp_path, test_fraction=1.0, root=root)
    assert main(["data", "stdlib-qa", str(tmp_path), "--max-modules", "-1"]) == 2


def test_jaxllm_data_stdlib_qa_on_the_running_python(tmp_path, capsys):
    assert main(["data", "stdlib-qa", str(tmp_path), "--max-modules", "5", "--seed", "3"]) == 0
    assert "questions about 5 modules of Python" in capsys.readouterr().out
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["modules"] == 5 and info["seed"] == 3
    assert set(info["questions"]["train"]) == {"args", "module"}


def test_preference_pairs_reject_a_near_miss(root, tmp_path):
    stdlib_qa.write_stdlib_qa(tmp_path, root=root, test_fraction=0.5)
    for name in ("train", "test"):
        questions = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
        file = "preference" if name == "train" else "preference_test"
        pairs = [json.loads(line) for line in open(tmp_path / f"{file}.jsonl")]
        assert len(pairs) == len(questions)
        for q, p in zip(questions, pairs):
            assert p["prompt"] == q["messages"][:1] and p["chosen"] == q["messages"][1]["content"]
            assert p["rejected"] != p["chosen"]
            if q["kind"] == "module":  # one dotted part too few or too many of the subject
                assert f"{p['subject']}.".startswith(f"{p['rejected']}.")
                assert abs(p["rejected"].count(".") - p["chosen"].count(".")) == 1
            elif "," in p["chosen"]:  # one argument left out, or two swapped
                wrong, right = p["rejected"].split(", "), p["chosen"].split(", ")
                assert set(wrong) < set(right) or sorted(wrong) == sorted(right)
        src = SourceConfig(path=str(tmp_path / f"{file}.jsonl"), format="preference")
        f = DataFile(tmp_path / f"{file}.jsonl", "preference", f"{file}.jsonl")
        assert len(list(preference.read_pairs(f, src, ByteTokenizer(), "fail"))) == len(pairs)
