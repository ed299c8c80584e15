"""`jaxllm generate`'s options (the command itself is `jaxllm.infer.cli`, loaded when it runs)."""

from __future__ import annotations

from pathlib import Path

from jaxllm.convert_cli import CHECKPOINT_HELP


def cmd_generate(ns) -> int:
    """`jaxllm generate` (`jaxllm.infer.cli`)."""
    from jaxllm.infer.cli import cmd_generate as run

    return run(ns)


def add_generate_parser(sub) -> None:
    """Adds `generate` to the command's subparsers."""
    g = sub.add_parser("generate", help="generate text from a trained run, with a KV cache")
    g.add_argument("args", nargs="+", metavar="RUN_DIR|CHECKPOINT|key=value")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    src.add_argument("--prompts-file", type=Path, help="one prompt per line")
    src.add_argument("--chat", metavar="MESSAGE", help="a user message: print the reply alone")
    src.add_argument("--chat-file", type=Path, metavar="F.jsonl", help="chat JSONL, a line each")
    g.add_argument("--system", help="--chat / --chat-file: a system message first")
    im = "--chat: an image (a path), put before the message in the user turn; repeatable"
    g.add_argument("--image", action="append", metavar="PATH", help=im)
    g.add_argument("--out", type=Path, metavar="F.jsonl", help="write the replies as a dataset")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    g.add_argument("--max-new-tokens", type=int, help="tokens per prompt at most")
    g.add_argument("--temperature", type=float, help="0 = greedy")
    g.add_argument("--top-k", type=int, help="0 = off")
    g.add_argument("--top-p", type=float, help="1 = off")
    g.add_argument("--seed", type=int)
    g.add_argument("--kv-cache-dtype", choices=("bfloat16", "float32", "int8", "int4", "int2"))
    g.add_argument("--kv-page-size", type=int, help="tokens per page; 0 = contiguous cache")
    g.add_argument("--decode-impl", choices=("auto", "xla", "kernel"))
    g.add_argument("--checkpoint", default="last", help=CHECKPOINT_HELP)
    ad = "a fine-tuning run on this base (RUN/adapters/NAME, or NAME=RUN); repeat to switch"
    g.add_argument("--adapter", action="append", metavar="NAME[=RUN]", help=ad)
    g.set_defaults(func=cmd_generate)
