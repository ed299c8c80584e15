"""Command-line pieces of `jaxllm data ...` and `jaxllm bench data`, wired in by `jaxllm.cli`.

    jaxllm data tokenizer SOURCE... --vocab-size N --out DIR     byte-level BPE -> DIR/tokenizer.json
    jaxllm data prepare SOURCE... --out DIR [--tokenizer T] [--workers N] [--shard-docs N]
    jaxllm bench data [CONFIG.yaml] [key=value ...] [--seconds S | --batches N]
    jaxllm data stdlib-qa OUT_DIR [--max-modules N] [--seed S] [--test-fraction F]
    jaxllm data shapes --out DIR [--samples N] [--seed S] [--grid G] [--size PX] [--test-fraction F]

A SOURCE is what `data.sources[i].path` accepts: `stdlib`, a directory, a glob or a file;
`--format` and the field options apply to all of them (`--format chat` / `prompt_completion`:
SFT examples; `data tokenizer` trains on them as the built-in chat template renders them).

The four writers build their output directory whole or not at all
(`jaxllm.config.outputs.written`): in a hidden temporary sibling, renamed into place when
complete. A DIR / OUT_DIR that already holds anything is refused unless `--overwrite`. Each
handler returns the exit code; a ConfigError propagates to `jaxllm.cli.main`, which prints it and
exits 2 (a RunError: exit 1).
"""

from __future__ import annotations

import argparse
import typing

from jaxllm.config import ConfigError, DataConfig, SourceConfig, load_args
from jaxllm.config.outputs import check_output, written
from jaxllm.config.urls import check_url

_FORMATS = typing.get_args(typing.get_type_hints(SourceConfig)["format"])


def _add_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "sources", nargs="+", metavar="SOURCE", help="stdlib, a directory, a glob or a file"
    )
    p.add_argument(
        "--format", default="auto", choices=_FORMATS, help="file format (default: by extension)"
    )
    p.add_argument("--text-field", default="text", help="JSONL / Parquet field holding the text")
    p.add_argument("--messages-field", default="messages", help="--format chat: the conversation")
    p.add_argument("--prompt-field", default="prompt", help="--format prompt_completion: prompt")
    p.add_argument(
        "--completion-field", default="completion", help="--format prompt_completion: completion"
    )
    for name in ("chosen", "rejected", "label"):
        p.add_argument(
            f"--{name}-field",
            default=name,
            help=f"--format {'unpaired_' if name == 'label' else ''}preference: {name}",
        )
    p.add_argument("--max-files", type=int, help="read at most this many files of each SOURCE")
    p.add_argument(
        "--on-bad-record",
        default="skip",
        choices=("skip", "fail"),
        help="a JSONL line that is not JSON or lacks the field (a malformed SFT example): warn "
        "and skip, or stop",
    )


def _add_overwrite(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an output directory that holds something (once the new one is complete)",
    )


def _sources(ns) -> list[SourceConfig]:
    fields = ("text_field", "messages_field", "prompt_field", "completion_field")
    fields += ("chosen_field", "rejected_field", "label_field")
    return [
        SourceConfig(
            path=check_url(p, "SOURCE"), format=ns.format, **{k: getattr(ns, k) for k in fields}
        )
        for p in ns.sources
    ]


def cmd_tokenizer(ns) -> int:
    from jaxllm.data import sft
    from jaxllm.data.sources import BadRecords, list_files, read_texts, refuse_output_over
    from jaxllm.data.tokenizer import (
        ByteTokenizer,
        check_bpe_vocab_size,
        load_tokenizer,
        train_bpe,
    )

    check_bpe_vocab_size(ns.vocab_size)
    out = check_output(ns.out, flag="--out", overwrite=ns.overwrite)
    sources = _sources(ns)
    files = [(src, list_files(src, "SOURCE", ns.max_files)) for src in sources]
    refuse_output_over(out, [f.path for _, fs in files for f in fs], "--out")
    bad = BadRecords(", ".join(ns.sources), ns.text_field)
    if sft.is_sft(sources[0]):
        bad = sft.bad_records(", ".join(ns.sources), sources[0])

    chars = [0]  # what the corpus held: none is refused, as `data prepare` refuses it

    def texts():
        for text in _texts():
            chars[0] += len(text)
            yield text

    def _texts():
        for src, src_files in files:
            for f in src_files:
                if sft.is_sft(src):  # the tokenizer has no template yet: the built-in one
                    no_vision = "a tokenizer is trained on text only"
                    examples = sft.read_examples(
                        f, src, ByteTokenizer(), ns.on_bad_record, bad, no_vision
                    )
                    yield from (ex.text for ex in examples)
                else:
                    yield from read_texts(f, src.text_field, ns.on_bad_record, bad)

    with written(out, flag="--out", overwrite=ns.overwrite) as tmp:
        train_bpe(texts(), ns.vocab_size, tmp)
        if not chars[0]:
            bad.warn()  # the records skipped, when that is why nothing was left
            raise ConfigError(
                f"the {sum(len(fs) for _, fs in files)} file(s) of {', '.join(ns.sources)} hold "
                "no text to train a tokenizer on; nothing was written."
            )
    path = out / "tokenizer.json"
    bad.warn()
    tok = load_tokenizer(str(path))
    short = ""
    if tok.vocab_size < ns.vocab_size:  # BPE stops when no pair of tokens is left to merge
        short = f", fewer than --vocab-size {ns.vocab_size}: the corpus has no more merges"
    print(
        f"wrote {path}: byte-level BPE, {tok.vocab_size} ids{short} (pad {tok.pad_id}, bos "
        f"{tok.bos_id}, eos {tok.eos_id}); train with data.tokenizer={path}"
    )
    return 0


def cmd_prepare(ns) -> int:
    from jaxllm import storage
    from jaxllm.data.prepare import prepare
    from jaxllm.data.sources import MANIFEST

    # --out s3://... / gs://...: built locally, published with the manifest last
    with storage.staged(ns.out, "--out", overwrite=ns.overwrite, last=[MANIFEST]) as out:
        manifest = prepare(
            _sources(ns),
            out,
            tokenizer=ns.tokenizer,
            workers=ns.workers,
            shard_docs=ns.shard_docs,
            max_files=ns.max_files,
            eval_fraction=ns.eval_fraction,
            on_bad_record=ns.on_bad_record,
            overwrite=ns.overwrite,
        )
    split = manifest["splits"]
    kind = manifest.get("kind")  # pairs and solutions: the source names its format
    named = f", format: {kind}" if kind in ("preference", "unpaired_preference", "stepwise") else ""
    print(
        f"wrote {len(manifest['shards'])} shard(s) to {ns.out}: {manifest['docs']:,} documents, "
        f"{manifest['tokens']:,} tokens ({split['train']['docs']:,} train / "
        f"{split['eval']['docs']:,} eval documents); train with "
        f"data.sources=[{{path: {ns.out}{named}}}]"
    )
    return 0


def cmd_stdlib_qa(ns) -> int:
    from jaxllm.data.stdlib_qa import write_stdlib_qa

    with written(ns.out_dir, flag="OUT_DIR", overwrite=ns.overwrite) as tmp:
        info = write_stdlib_qa(tmp, ns.max_modules or None, ns.seed, ns.test_fraction)
    counts = {k: sum(v.values()) for k, v in info["questions"].items()}
    print(
        f"wrote {counts['train']:,} train and {counts['test']:,} test questions about "
        f"{info['modules']} modules of Python {info['python']}'s standard library to "
        f"{ns.out_dir} (train.jsonl, test.jsonl: format chat; preference.jsonl, "
        "preference_test.jsonl: the same questions as format preference pairs)"
    )
    return 0


def cmd_shapes(ns) -> int:
    from jaxllm.data.shapes_vqa import write_shapes_vqa

    with written(ns.out, flag="--out", overwrite=ns.overwrite) as tmp:
        info = write_shapes_vqa(tmp, ns.samples, ns.seed, ns.grid, ns.size, ns.test_fraction)
    counts = {k: sum(v.values()) for k, v in info["questions"].items()}
    print(
        f"wrote {counts['train']:,} train and {counts['test']:,} test questions about drawn "
        f"{info['size']}x{info['size']} images of a {info['grid']}x{info['grid']} grid to "
        f"{ns.out} (train.jsonl, test.jsonl: format chat, images under images/; tokenizer/)"
    )
    return 0


def cmd_bench_data(ns) -> int:
    from jaxllm.data.bench import bench_data, format_data_result

    cfg = load_args(ns.args)
    print(format_data_result(bench_data(cfg, seconds=ns.seconds, batches=ns.batches)))
    return 0


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `data tokenizer`, `data prepare`, `data stdlib-qa` and `data shapes` to the top-level
    subparsers."""
    d = subparsers.add_parser("data", help="train a tokenizer, tokenize corpora into shards")
    dsub = d.add_subparsers(dest="data_command", required=True)
    t = dsub.add_parser("tokenizer", help="train a byte-level BPE tokenizer -> DIR/tokenizer.json")
    _add_source_args(t)
    t.add_argument("--vocab-size", type=int, required=True, help="ids, with 256 bytes + 3 specials")
    t.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory")
    _add_overwrite(t)
    t.set_defaults(func=cmd_tokenizer)
    p = dsub.add_parser("prepare", help="tokenize once into ArrayRecord shards + manifest.json")
    _add_source_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory")
    _add_overwrite(p)
    p.add_argument("--tokenizer", default="byte", help="byte, a tokenizer.json or a .model")
    p.add_argument("--workers", type=int, default=0, help="tokenizer processes (0: in this one)")
    p.add_argument("--shard-docs", type=int, default=10_000, help="documents per shard")
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=DataConfig.eval_fraction,
        help="fraction held out as eval shards: of the files by path hash, of the records "
        "(by file and record number) when a source has too few files; 0: none",
    )
    p.set_defaults(func=cmd_prepare)
    q = dsub.add_parser(
        "stdlib-qa", help="questions about the standard library -> train/test chat JSONL"
    )
    q.add_argument("out_dir", metavar="OUT_DIR", help="a new (or empty) directory")
    _add_overwrite(q)
    q.add_argument("--max-modules", type=int, default=40, help="modules asked about (0: all)")
    q.add_argument("--seed", type=int, default=0, help="salts the split and the phrasings")
    q.add_argument(
        "--test-fraction", type=float, default=0.2, help="subjects held out, by their hash"
    )
    q.set_defaults(func=cmd_stdlib_qa)
    s = dsub.add_parser(
        "shapes", help="questions about drawn shapes -> PNG images + train/test chat JSONL"
    )
    s.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory")
    _add_overwrite(s)
    s.add_argument("--samples", type=int, default=1000, help="images, one question each")
    s.add_argument("--seed", type=int, default=0, help="draws the scenes and the questions")
    s.add_argument("--grid", type=int, default=3, help="cells a side")
    s.add_argument("--size", type=int, default=112, help="pixels a side of each image")
    s.add_argument("--test-fraction", type=float, default=0.2, help="the last scenes, held out")
    s.set_defaults(func=cmd_shapes)
    return d


def add_bench_data_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Adds `bench data` to the subparsers of `bench`."""
    b = bench_subparsers.add_parser("data", help="tokens/s of the input pipeline alone (no model)")
    b.add_argument("args", nargs="*", metavar="CONFIG|key=value")
    how_long = b.add_mutually_exclusive_group()
    how_long.add_argument("--seconds", type=float, help="time this long (default 10)")
    how_long.add_argument("--batches", type=int, help="time exactly this many batches")
    b.set_defaults(func=cmd_bench_data)
    return b
