"""Chat with a run: the end-of-turn marker of each kind of template (a token, or text to stop
at), prompts and replies, conversations of a chat JSONL, and `jaxllm generate --chat` /
`--chat-file` and `jaxllm eval --chat-exact-match` on a tiny trained run (plain and LoRA)."""

import json

import pytest
from conftest import SMALL_RUN
from test_data_chat import LLAMA3, QWEN, bpe

from jaxllm import config
from jaxllm.cli import main
from jaxllm.config import ConfigError, GenerateConfig
from jaxllm.data import tokenizer as tokenizer_lib
from jaxllm.data.pipeline import load_splits
from jaxllm.infer import chat
from jaxllm.infer.cli import load_chat
from jaxllm.infer.generate import generate

ASK = [{"role": "user", "content": "Which module defines `heappush`?"}]


def test_builtin_template_ends_a_turn_with_text_for_the_byte_tokenizer():
    tok = tokenizer_lib.ByteTokenizer()
    eot = chat.end_of_turn(tok, stop_ids=[7])
    assert eot.marker == "<|im_end|>"
    assert eot.stop_ids == {tok.eos_id, 7}
    assert eot.stop_sequences == (tuple(b"<|im_end|>"),)  # ten bytes: stopped as a sequence
    ids = chat.prompt_ids(ASK, tok)
    assert bytes(ids).decode().endswith("?<|im_end|>\n<|im_start|>assistant\n")
    said = tok.encode("  heapq <|im_end|>\n<|im_start|>user\n").tolist()
    assert chat.reply_text(said, tok, eot) == "heapq"


@pytest.mark.parametrize("template, marker", [(LLAMA3, "<|eot_id|>"), (QWEN, "<|im_end|>")])
def test_a_template_special_ends_a_turn_as_one_token(tmp_path, template, marker):
    tok = tokenizer_lib.load_tokenizer(str(bpe(tmp_path, template)))
    eot = chat.end_of_turn(tok)
    assert eot.marker == marker and eot.stop_sequences == ()
    assert eot.stop_ids == {tok.eos_id, tok._tok.token_to_id(marker)}
    ids = chat.prompt_ids(ASK, tok)  # the generation prompt's header is its special token
    header = "<|start_header_id|>" if template == LLAMA3 else "<|im_start|>"
    assert ids.count(tok._tok.token_to_id(header)) == (2 if template == LLAMA3 else 3)  # system
    text = tok._tok.decode(ids, skip_special_tokens=False)
    assert text == chat.templates.render(ASK, tok, add_generation_prompt=True)


def test_conversations_split_at_the_last_user_turn(tmp_path):
    system = {"role": "system", "content": "Be brief."}
    answer = {"role": "assistant", "content": "heapq"}
    assert chat.split_conversation([system, *ASK, answer]) == chat.Conversation(
        (system, *ASK), "heapq"
    )
    assert chat.split_conversation([*ASK, answer, *ASK]).reference is None
    with pytest.raises(ConfigError, match="has no user message"):
        chat.split_conversation([system])
    with pytest.raises(ConfigError, match="2 messages after its last user turn"):
        chat.split_conversation([*ASK, answer, answer])
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"messages": [*ASK, answer]}) + "\n\n" + "{oops\n")
    with pytest.raises(ConfigError, match="c.jsonl line 3 is not valid JSON"):
        chat.read_conversations(f)
    f.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(ConfigError, match="line 1 has no 'messages' field"):
        chat.read_conversations(f)
    assert chat.normalize("  a,\n b  ") == "a, b"


# -- a tiny run that learned to answer ---------------------------------------------------------


SYSTEM = {"role": "system", "content": "Be brief."}


def _chats(path, n, answer=lambda i: "heapq", system=lambda i: False):
    rows = [
        {
            "messages": [SYSTEM] * system(i)
            + [
                {"role": "user", "content": f"Which module defines `f{i}`?"},
                {"role": "assistant", "content": answer(i)},
            ]
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """A SMALL_RUN model fine-tuned from scratch until it answers `heapq` to "Which module
    defines `fN`?", with or without a system message, and ends its turn (the built-in
    template's `<|im_end|>`, ten bytes). Its cache is float32, as its weights."""
    root = tmp_path_factory.mktemp("answers")
    data = _chats(root / "qa.jsonl", 32, system=lambda i: i % 2)
    source = f"[{{path: {data}, format: chat}}]"
    overrides = [f"data.sources={source}", f"data.eval_sources={source}", "data.seq_len=160"]
    overrides += ["train.objective=sft", "train.steps=40", "optim.lr=1e-2", "train.log_every=20"]
    overrides += ["generate.kv_cache_dtype=float32"]
    assert main(["train", *SMALL_RUN, *overrides, f"run.dir={root / 'run'}"]) == 0
    return root / "run"


def test_generation_stops_at_the_text_marker_and_the_reply_leaves_it_out(answers):
    """A model that has learned to end its replies: the in-loop stop sequence ends the reply
    before `max_new_tokens`."""
    c = load_chat(answers)
    asked = [{"role": "user", "content": "Which module defines `f3`?"}]
    ids = chat.prompt_ids(asked, c.tok)
    gen = GenerateConfig(max_new_tokens=40, kv_cache_dtype="float32")
    out = generate(c.model, [ids], gen, stop_sequences=c.eot.stop_sequences)
    assert out.stopped == [True]
    assert c.tok.decode(out.tokens[0]) == "heapq"
    assert c.reply(asked) == "heapq"


def test_generate_chat_prints_the_reply_alone(answers, capsys):
    asked = "Which module defines `f5`?"
    assert main(["generate", str(answers), "--chat", asked]) == 0
    assert capsys.readouterr().out == "heapq\n"
    assert main(["generate", str(answers), "--chat", asked, "--system", "Be brief."]) == 0
    assert capsys.readouterr().out == "heapq\n"


def test_generate_chat_file_prints_a_json_line_per_conversation(answers, tmp_path, capsys):
    asked = _chats(tmp_path / "ask.jsonl", 3, lambda i: "json")
    with open(asked, "a") as f:  # no reference
        f.write(
            json.dumps({"messages": [{"role": "user", "content": "Which module defines `f9`?"}]})
            + "\n"
        )
    assert main(["generate", str(answers), "--chat-file", str(asked)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [{"reply": "heapq", "reference": "json"}] * 3 + [{"reply": "heapq"}]


def test_generate_out_writes_a_chat_dataset_a_student_trains_on(answers, tmp_path, capsys):
    """Black-box distillation: the teacher's replies to a chat file become a `format: chat`
    dataset (the asked turns, then the reply), which SFT reads; prompts become
    prompt/completion records; an existing --out is refused and kept."""
    asked = _chats(tmp_path / "ask.jsonl", 3, lambda i: "json")
    out = tmp_path / "teacher.jsonl"
    argv = ["generate", str(answers), "--chat-file", str(asked), "--system", "Be brief."]
    assert main([*argv, "--out", str(out)]) == 0
    assert capsys.readouterr().out == ""
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][-1] for r in rows] == [{"role": "assistant", "content": "heapq"}] * 3
    assert rows[0]["messages"][:2] == [
        SYSTEM,
        {"role": "user", "content": "Which module defines `f0`?"},
    ]
    before = out.read_text()
    assert main([*argv, "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err and out.read_text() == before
    source = f"[{{path: {out}, format: chat}}]"  # what a student's SFT run reads
    keys = [f"data.sources={source}", f"data.eval_sources={source}", "data.seq_len=160"]
    cfg = config.load(None, ["train.objective=sft", *keys])
    train_rows, _ = load_splits(cfg.data, 0, False)
    assert train_rows.num_docs == 3 and len(train_rows) >= 1
    plain = tmp_path / "completions.jsonl"
    argv = ["generate", str(answers), "--prompt", "def ", "--prompt", "import "]
    assert main([*argv, "--max-new-tokens", "3", "--out", str(plain)]) == 0
    rows = [json.loads(line) for line in plain.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["def ", "import "]
    assert all(isinstance(r["completion"], str) for r in rows)


@pytest.mark.slow
def test_eval_chat_exact_match_of_a_plain_and_a_lora_run(answers, tmp_path, capsys):
    test = _chats(tmp_path / "test.jsonl", 4, lambda i: "heapq" if i % 2 else " json ")
    replies = tmp_path / "replies.jsonl"
    args = ["--chat-exact-match", str(test)]
    assert main(["eval", str(answers), *args, "--replies", str(replies)]) == 0
    assert "exact match 2/4 = 0.500 (greedy" in capsys.readouterr().out
    assert [json.loads(line)["correct"] for line in replies.read_text().splitlines()] == [
        False,
        True,
    ] * 2
    # LoRA adapters on top, loaded unmerged: B starts at zero, so two small steps keep replies
    lora = tmp_path / "lora"
    overrides = ["peft.method=lora", f"checkpoint.init_from={answers}", "optim.lr=1e-4"]
    source = f"[{{path: {answers.parent / 'qa.jsonl'}, format: chat}}]"
    overrides += [f"data.sources={source}", f"data.eval_sources={source}", "data.seq_len=160"]
    overrides += ["train.objective=sft", "train.steps=2", f"run.dir={lora}"]
    assert main(["train", *SMALL_RUN, *overrides]) == 0
    capsys.readouterr()
    assert main(["eval", str(lora), *args]) == 0
    assert "step 2: exact match 2/4 = 0.500" in capsys.readouterr().out
    assert load_chat(lora).exact_match(chat.read_conversations(test)).accuracy == 0.5
