"""`jaxllm generate RUN_DIR --prompt TEXT ...`: sample from a trained run with a KV cache.

`--chat MESSAGE [--system TEXT]` asks one user message through the run's chat template and
prints the reply alone; `--chat-file F.jsonl` asks each conversation of a chat JSONL (up to its
last user turn) and prints one JSON object per line, `{"reply": ...}` with the conversation's
own final assistant turn as `"reference"` when it has one (`jaxllm.infer.chat`).
`jaxllm eval RUN_DIR --chat-exact-match F.jsonl` prints the greedy replies' exact-match accuracy.

`--out FILE.jsonl` writes a dataset instead of printing: with `--chat` / `--chat-file`, one
`format: chat` record per conversation, `{"messages": [...the conversation up to its last user
turn, {"role": "assistant", "content": REPLY}]}` (black-box distillation: the teacher's answers,
which SFT of a student trains on); with `--prompt` / `--prompts-file`, one `format:
prompt_completion` record `{"prompt": ..., "completion": ...}` per prompt. FILE appears only
when complete, and an existing one is refused unless `--overwrite`.

`--adapter NAME[=RUN]` (repeatable) generates with fine-tuning runs of one base, switched
without reloading it: the base is loaded once, from the first adapter's record, and each
adapter restores only its own parameters (LoRA factors, a soft prompt, bottleneck adapters).
`NAME` alone is the run the positional run holds as RUN/adapters/NAME (a directory or a link);
`NAME=RUN` names one anywhere. Every prompt (or conversation) is answered by each adapter in
turn: printed under `[NAME]`, or with an `"adapter"` field in the JSON lines and `--out`.

Only generated text goes to stdout (streamed as it is made when there is one prompt and one
device, since the streaming host callback is ordered, which jax allows on a single device only;
one block per prompt otherwise); the cache size and speed go to stderr. A sequence ends at any of its stop
ids: the tokenizer's EOS, the `eos_token_id` (one or a list) of a generation_config.json beside
the tokenizer file or in the run directory (a Hugging Face import brings one), and
`generate.stop_tokens`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from jaxllm import checkpoint
from jaxllm.config import ConfigError, split_args
from jaxllm.config.urls import check_url
from jaxllm.data import images
from jaxllm.data.tokenizer import (
    check_coverage,
    generation_config,
    generation_stop_ids,
    make_tokenizer,
)
from jaxllm.infer.chat import Chat, Conversation, read_conversations
from jaxllm.infer.generate import generate
from jaxllm.load import BASE_ITEM, fetched, resolve, restore
from jaxllm.model import merge_model


def _overrides(ns: argparse.Namespace) -> list[str]:
    flags = (
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "kv_cache_dtype",
        "kv_page_size",
        "decode_impl",
    )
    return [f"generate.{f}={getattr(ns, f)}" for f in flags if getattr(ns, f) is not None]


class _Stream:
    """Prints one sequence's text as tokens arrive (whole UTF-8 characters only; `finish`
    prints what is left, so the output is always the decoding of every generated token)."""

    def __init__(self, tok, stops: set[int]):
        self.tok, self.stops, self.ids, self.shown = tok, stops, [], 0

    def __call__(self, step, tokens_B, done_B) -> None:
        t = int(tokens_B[0])
        if bool(done_B[0]) or t in self.stops:
            return
        self.ids.append(t)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # a character still incomplete
            return
        sys.stdout.write(text[self.shown :])
        sys.stdout.flush()
        self.shown = len(text)

    def finish(self) -> None:
        """Prints the rest: a last character the sequence left incomplete."""
        sys.stdout.write(self.tok.decode(self.ids)[self.shown :])


def _with_system(messages, system: str | None):
    if system is None or any(m.get("role") == "system" for m in messages):
        return tuple(messages)
    return ({"role": "system", "content": system}, *messages)


def _check_generates(cfg, path) -> None:
    """A reward model has no LM head and an encoder no causal one: nothing to sample from."""
    if cfg.model.kind == "encoder":
        raise ConfigError(
            f"{path} is an encoder (model.kind=encoder): it fills in masked tokens and cannot "
            "generate; give a decoder's run."
        )
    if cfg.model.head == "score":
        raise ConfigError(
            f"{path} is a reward model (model.head=score): it scores sequences "
            "(jaxllm.infer.reward.score) and cannot generate; give a language model's run."
        )


def named_adapters(path, specs: list[str]) -> list[tuple[str, Path]]:
    """(name, run) of each `--adapter`: `NAME=RUN` names a fine-tuning run; `NAME` alone, the
    one the run PATH holds as PATH/adapters/NAME (a run directory, or a link to one), else the
    run directory at the path NAME, named by its last part."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, eq, run = spec.partition("=")
        if not name or (eq and not run):
            raise ConfigError(f"--adapter {spec!r}: give NAME or NAME=RUN_DIR.")
        where = Path(run) if eq else resolve(path)[0] / "adapters" / name
        if not eq and Path(name).is_dir() and (len(Path(name).parts) > 1 or not where.exists()):
            name, where = Path(name).name, Path(name)  # a run's path, named by its directory
        if name in out:
            raise ConfigError(f"--adapter {name} is given twice; give each name once.")
        if not where.exists():
            raise ConfigError(
                f"--adapter {spec}: {where} does not exist; name a fine-tuning run as "
                "NAME=RUN_DIR, or put it in the run's adapters/ directory."
            )
        out[name] = where
    return list(out.items())


def adapter_models(path, specs: list[str], overrides, which: str):
    """[(name, config, step, model)] of the `--adapter`s (`named_adapters`), their frozen base
    loaded once, from the first, and shared: each other adapter restores only its own
    parameters. They must be fine-tuning runs of one base (the same base record and frozen
    form), else ConfigError."""
    named = named_adapters(path, specs)
    first = restore(named[0][1], overrides, which=which)
    out = []
    for i, (name, run) in enumerate(named):
        r = first if i == 0 else restore(run, overrides, mesh=first.mesh, base=False, which=which)
        if r.cfg.peft.method == "none":
            raise ConfigError(f"--adapter {name}: {run} is a full run, not a fine-tuning run.")
        base = checkpoint.read_json_item(_ckpt_dir(run, r.cfg), r.step, BASE_ITEM)
        if i == 0:
            first_base = base
        same = (r.cfg.peft.method == "qlora") == (first.cfg.peft.method == "qlora")
        if base != first_base or not same or r.cfg.quantize != first.cfg.quantize:
            raise ConfigError(
                f"--adapter {name}: {run} was fine-tuned on another base (or holds it in "
                f"another form) than --adapter {named[0][0]}; adapters switched on one base "
                "must share it."
            )
        model = merge_model(r.graphdef, r.params, first.frozen, r.model_state)
        out.append((name, r.cfg, r.step, model))
    return out, first.mesh


def _models(ns, path, overrides):
    """([(adapter name or None, config, step, model)], mesh): the run's own model, or with
    `--adapter` each named adapter on the one base."""
    overrides = [*overrides, *_overrides(ns)]
    if ns.adapter:
        return adapter_models(path, ns.adapter, overrides, ns.checkpoint)
    r = restore(path, overrides, which=ns.checkpoint)
    return [(None, r.cfg, r.step, r.model())], r.mesh


def _ckpt_dir(run, cfg) -> Path:
    run_dir, ckpt_dir, _ = resolve(run)
    return ckpt_dir or checkpoint.checkpoint_dir(run_dir, cfg.checkpoint.dir)


def _chats(ns, path, overrides) -> list[tuple[str | None, Chat]]:
    """The run's `Chat`, or with `--adapter` one per named adapter on the one base."""
    return _chats_of(*_models(ns, path, overrides), path)


def _chats_of(models, mesh, path) -> list[tuple[str | None, Chat]]:
    """[(name, Chat)] of `_models`' models: the run's tokenizer, `generate` section and stop
    ids (generation_config.json's, as `jaxllm generate` reads them)."""
    cfg = models[0][1]
    _check_generates(cfg, path)
    tok = make_tokenizer(cfg.data)
    check_coverage(tok, cfg.model.vocab_size, "chat")
    stops = generation_stop_ids(generation_config(cfg.data.tokenizer, resolve(path)[0]))
    out = []
    for name, cfg, step, model in models:
        chat = Chat(model, tok, cfg.generate, stop_ids=stops, mesh=mesh)
        chat.step = step
        out.append((name, chat))
    return out


def load_chat(path, overrides=(), which: str = "last") -> Chat:
    """A `jaxllm.infer.chat.Chat` of a run: its model (adapters unmerged for a PEFT run),
    tokenizer, `generate` section and stop ids. `which`: `--checkpoint best|last|STEP`."""
    r = restore(path, overrides, which=which)
    return _chats_of([(None, r.cfg, r.step, r.model())], r.mesh, path)[0][1]


def check_out_file(out: Path | None, overwrite: bool) -> None:
    """ConfigError, before any work, when `--out` cannot be written as a new file."""
    if out is None:
        return
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a .jsonl file to write.")
    if out.exists() and not overwrite:
        raise ConfigError(
            f"--out {out} already exists; choose a new file, or pass --overwrite to replace it."
        )
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: its directory {out.parent} does not exist.")


def write_jsonl(out: Path, records) -> None:
    """`records` as JSON lines to `out`, which appears only when complete."""
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def cmd_chat(ns: argparse.Namespace, path: str, overrides: list[str]) -> int:
    """--chat / --chat-file: replies only (see the module docstring)."""
    if ns.chat is not None:
        content = ns.chat
        if ns.image:  # images first, then the text, as Qwen-VL's processor orders them
            content = [*({"type": "image", "image": p} for p in ns.image), _text(ns.chat)]
        conversations = [Conversation(({"role": "user", "content": content},))]
    else:
        conversations = read_conversations(ns.chat_file)
    asked = [_with_system(c.messages, ns.system) for c in conversations]
    records = []
    for name, chat in _chats(ns, path, overrides):  # one base, each adapter in turn
        tag = {"adapter": name} if name else {}
        t0 = time.perf_counter()
        replies = chat.replies(
            [Conversation(a, None, c.base_dir) for a, c in zip(asked, conversations)]
        )
        if ns.out is not None:  # a chat dataset of the replies
            records += [
                {"messages": [*a, {"role": "assistant", "content": r}], **tag}
                for a, r in zip(asked, replies)
            ]
        elif ns.chat is not None:
            print(f"[{name}] {replies[0]}" if name else replies[0])
        else:
            for reply, c in zip(replies, conversations):
                ref = {"reference": c.reference} if c.reference is not None else {}
                print(json.dumps({"reply": reply, **ref, **tag}, ensure_ascii=False))
        print(
            f"{f'[{name}] ' if name else ''}step {chat.step}: {len(replies)} "
            f"repl{'y' if len(replies) == 1 else 'ies'} in {time.perf_counter() - t0:.2f}s "
            "including compilation",
            file=sys.stderr,
        )
    if ns.out is not None:
        write_jsonl(ns.out, records)
        print(f"wrote {len(records)} conversations to {ns.out}", file=sys.stderr)
    return 0


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _check_images(paths: list[str]) -> None:
    """ConfigError, before the model loads, for an --image that is missing or not an image."""
    for path in paths:
        try:
            images.load_image(path)
        except images.ImageError as e:
            raise ConfigError(
                f"--image {path}: {e.reason}; give a PNG, JPEG or other image."
            ) from None


def cmd_exact_match(ns: argparse.Namespace) -> int:
    """`jaxllm eval RUN_DIR --chat-exact-match F.jsonl [--replies OUT.jsonl]`."""
    path, overrides = split_args(ns.args)
    if path is None:
        raise ConfigError("jaxllm eval needs a run directory or checkpoint path.")
    path = fetched(check_url(path, "RUN_DIR"), "RUN_DIR")  # a bucket's run: its local copy
    conversations = read_conversations(ns.chat_exact_match)
    chat = load_chat(path, overrides, ns.checkpoint)
    score = chat.exact_match(conversations)
    if ns.replies is not None:
        with open(ns.replies, "w") as f:
            for c, reply, ok in zip(conversations, score.replies, score.correct):
                record = {"reply": reply, "reference": c.reference, "correct": ok}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(
        f"step {chat.step}: exact match {sum(score.correct)}/{len(score.correct)} = "
        f"{score.accuracy:.3f} (greedy, {ns.chat_exact_match})"
    )
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    path, overrides = split_args(ns.args)
    if path is None:
        raise ConfigError("jaxllm generate needs a run directory or checkpoint path.")
    path = fetched(check_url(path, "RUN_DIR"), "RUN_DIR")  # a bucket's run: its local copy
    if ns.system is not None and ns.chat is None and ns.chat_file is None:
        raise ConfigError("--system goes with --chat or --chat-file; add one of them.")
    check_out_file(ns.out, ns.overwrite)
    if ns.image and ns.chat is None:
        raise ConfigError("--image goes with --chat MESSAGE (the images go in its user turn).")
    _check_images(ns.image or [])
    if ns.chat is not None or ns.chat_file is not None:
        return cmd_chat(ns, path, overrides)
    if ns.prompt:
        prompts = ns.prompt
    else:
        if not ns.prompts_file.is_file():
            raise ConfigError(f"--prompts-file {ns.prompts_file} does not exist.")
        prompts = [ln for ln in ns.prompts_file.read_text().splitlines() if ln.strip()]
        if not prompts:
            raise ConfigError(f"--prompts-file {ns.prompts_file} has no prompts.")

    models, mesh = _models(ns, path, overrides)
    cfg = models[0][1]
    _check_generates(cfg, path)

    tok = make_tokenizer(cfg.data)
    check_coverage(tok, cfg.model.vocab_size, "jaxllm generate")
    bos = [tok.bos_id] if cfg.data.add_bos and tok.bos_id is not None else []
    ids = [bos + tok.encode(p).tolist() for p in prompts]
    stops = {tok.eos_id} if tok.eos_id is not None else set()
    stops |= generation_stop_ids(generation_config(cfg.data.tokenizer, resolve(path)[0]))
    streams = len(prompts) == 1 and len(models) == 1 and mesh.devices.size == 1
    stream = _Stream(tok, stops | set(cfg.generate.stop_tokens)) if streams and not ns.out else None
    records = []
    for name, cfg, step, model in models:  # one base, each adapter in turn (--adapter)
        t0 = time.perf_counter()
        try:
            out = generate(
                model, ids, cfg.generate, stop_tokens=sorted(stops), mesh=mesh, on_token=stream
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        secs = time.perf_counter() - t0
        texts = [tok.decode(new) for new in out.tokens]
        tag = {"adapter": name} if name else {}
        records += [{"prompt": p, "completion": t, **tag} for p, t in zip(prompts, texts)]
        if ns.out is None and stream is None:
            head = f"[{name}]\n" if name else ""
            sys.stdout.write(("\n\n" if name != models[0][0] else "") + head)
            sys.stdout.write("\n\n".join(texts))
        elif stream is not None:
            stream.finish()
        if ns.out is None:
            sys.stdout.write("\n")
        n_new = sum(len(t) for t in out.tokens)
        g = cfg.generate
        print(
            f"{f'[{name}] ' if name else ''}step {step}: {len(prompts)} prompt(s), {n_new} new "
            f"tokens in {secs:.2f}s including compilation; kv cache {g.kv_cache_dtype}"
            f"{f' paged ({g.kv_page_size} tokens/page)' if g.kv_page_size else ''}: "
            f"{out.cache_bytes_per_token:,} bytes/token, {out.cache_bytes / 2**20:.2f} MiB "
            "allocated",
            file=sys.stderr,
        )
    if ns.out is not None:
        write_jsonl(ns.out, records)
        print(f"wrote {len(records)} completions to {ns.out}", file=sys.stderr)
    return 0
