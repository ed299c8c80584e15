"""Chat templates and the SFT loss mask: rendering as transformers does, the assistant spans of
every turn, and the mask over tokens that do not end on character boundaries."""

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from jaxllm.config import ConfigError
from jaxllm.data import chat, sft
from jaxllm.data import tokenizer as tokenizer_lib

CHAT = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hi there, dog"},
    {"role": "assistant", "content": " Héllo, cat. "},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4 wörlds"},
]
REPLIES = [" Héllo, cat. ", "4 wörlds"]
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
SPECIALS += ["<|im_start|>", "<|im_end|>"]
# Meta-Llama-3-8B-Instruct's template, as its tokenizer_config.json holds it.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
    "<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5's, less the tools: whitespace control, trim_blocks and lstrip_blocks at work.
QWEN = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}
        {{- '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def bpe(tmp_path, template: str | None) -> Path:
    """A tiny byte-level BPE with chat specials, and tokenizer_config.json naming them."""
    texts = ["the cat sat on the mat and the dog sat on the log. héllo wörld " * 4]
    path = tokenizer_lib.train_bpe(texts, 300, tmp_path / "tok")
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    config |= {"tokenizer_class": "PreTrainedTokenizerFast"}
    (path.parent / "tokenizer_config.json").write_text(
        json.dumps(config | {"chat_template": template})
    )
    return path


def trained_runs(tok, ids, mask) -> list[str]:
    """The text of each run of consecutive trained tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    decode = getattr(tok, "_tok", None)
    return [
        decode.decode(ids[a:b].tolist(), skip_special_tokens=False)
        if decode
        else tok.decode(ids[a:b])
        for a, b in zip(edges[::2], edges[1::2])
    ]


def encode(tok, messages, template=None):
    ex = sft.Example(*chat.assistant_spans(messages, tok, template))
    out = sft.encode_examples(tok, [ex], "chat")
    return out.tokens[0], out.masks[0]


def test_builtin_template_is_chatml_text():
    tok = tokenizer_lib.ByteTokenizer()
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT[:2])
    assert chat.render(CHAT[:2], tok) == turns
    assert (
        chat.render(CHAT[:2], tok, add_generation_prompt=True) == turns + "<|im_start|>assistant\n"
    )
    ids, mask = encode(tok, CHAT)
    assert tok.decode(ids) == chat.render(CHAT, tok)  # bytes: the template's text, nothing added
    assert trained_runs(tok, ids, mask) == [r + "<|im_end|>" for r in REPLIES]


def test_mask_covers_each_reply_and_its_end_of_turn_token(tmp_path):
    tok = tokenizer_lib.load_tokenizer(str(bpe(tmp_path, LLAMA3)))
    ids, mask = encode(tok, CHAT)
    # Llama 3 trims the content; `é` and `ö` are two byte-level tokens each
    assert trained_runs(tok, ids, mask) == [r.strip() + "<|eot_id|>" for r in REPLIES]
    assert ids[0] == tok._tok.token_to_id("<|begin_of_text|>")  # the template writes BOS
    assert (ids == tok._tok.token_to_id("<|eot_id|>")).sum() == len(CHAT)  # read as specials


def test_generation_markers_and_rewriting_templates_give_the_same_spans(tmp_path):
    tok = tokenizer_lib.load_tokenizer(str(bpe(tmp_path, QWEN)))
    marked = encode(tok, CHAT)
    plain = encode(
        tok, CHAT, QWEN.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    )
    np.testing.assert_array_equal(marked[0], plain[0])
    np.testing.assert_array_equal(marked[1], plain[1])
    assert trained_runs(tok, *marked) == [r + "<|im_end|>" for r in REPLIES]
    # ends the conversation with a token it writes only then: renderings are not prefixes, so
    # the first reply is found by its text; the last turn adds what the template ends with
    rewriting = chat.BUILTIN_TEMPLATE.replace("{% endif %}", "{% else %}<|endoftext|>{% endif %}")
    text, spans = chat.assistant_spans(CHAT, tok, rewriting)
    assert [text[a:b] for a, b in spans] == [
        REPLIES[0] + "<|im_end|>",
        REPLIES[1] + "<|im_end|>\n<|endoftext|>",
    ]


def test_token_mask_counts_tokens_straddling_a_span_edge():
    # tokens: "ab" | "c" (first byte) | "" (second byte of c) | "de" | "f", span "cd"
    offsets = np.array([[0, 2], [2, 3], [3, 3], [3, 5], [5, 6]])
    assert sft.token_mask(offsets, [(2, 4)], 6).tolist() == [0, 1, 1, 1, 0]
    assert sft.token_mask(offsets, [(5, 6)], 6).tolist() == [0, 0, 0, 0, 1]
    assert sft.token_mask(offsets, [], 6).tolist() == [0] * 5


def test_template_errors(tmp_path):
    tok = tokenizer_lib.ByteTokenizer()
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    with pytest.raises(chat.ChatError, match="user first"):
        chat.render(CHAT, tok, template=strict)
    with pytest.raises(ConfigError, match="chat template does not parse"):
        chat.render(CHAT, tok, template="{% for m in messages %}")
    assert chat.render(
        [{"role": "user", "content": "é<"}], tok, template="{{ messages|tojson }}"
    ) == (
        '[{"role": "user", "content": "é<"}]'  # transformers' tojson: no ASCII or HTML escapes
    )


@pytest.mark.torch
def test_rendering_and_ids_and_mask_equal_transformers(tmp_path):
    import transformers

    for template in (LLAMA3, QWEN):
        path = bpe(tmp_path / template[:5].strip("{%- "), template)
        tok = tokenizer_lib.load_tokenizer(str(path))
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(path.parent))
        for messages in (CHAT, CHAT[1:4]):
            for prompt in (False, True):
                expected = hf.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=prompt
                )
                assert chat.render(messages, tok, add_generation_prompt=prompt) == expected
        ids, mask = encode(tok, CHAT)
        assert ids.tolist() == hf.apply_chat_template(CHAT)["input_ids"]
    out = hf.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    assert mask.tolist() == out["assistant_masks"]  # QWEN marks its replies with {% generation %}


def test_every_tokenizer_gives_the_characters_of_its_ids(tmp_path):
    import sentencepiece as spm

    text = "the cat sat on the mat, héllo wörld <|eot_id|>"
    (tmp_path / "corpus.txt").write_text("\n".join([text] * 20))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=40,
        model_type="bpe",
        minloglevel=2,
    )
    for spec in ("byte", str(bpe(tmp_path, None)), str(tmp_path / "sp.model")):
        tok = tokenizer_lib.load_tokenizer(spec)
        ids, offsets = tok.encode_offsets(text)
        assert ids.tolist() == tok.encode(text).tolist()  # specials in the text stay text
        assert (np.diff(offsets[:, 0]) >= 0).all() and offsets.min() >= 0
        assert offsets.max() == len(text)
        # the completion "wörld <|eot_id|>" of a prompt/completion example, by its characters
        mask = sft.token_mask(offsets, [(text.index("w"), len(text))], len(text))
        assert tok.decode(ids[mask == 1]).strip() == "wörld <|eot_id|>"
