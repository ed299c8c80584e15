"""The `jaxllm` command line.

    jaxllm train [CONFIG.yaml|RUN_DIR|s3://... gs://... run] [key=value ...]
        [--coordinator H:P --num-processes N --process-id I]
    jaxllm eval RUN_DIR|CHECKPOINT [key=value ...] [--batches N] [--checkpoint best|last|STEP]
    jaxllm eval RUN_DIR|CHECKPOINT --chat-exact-match F.jsonl [--replies OUT.jsonl]
    jaxllm eval RUN_DIR|CHECKPOINT --harness TASKS [--include-path DIR] [--limit N]
        [--num-fewshot K] [key=value ...]   (EleutherAI's lm-evaluation-harness: jaxllm.harness)
    jaxllm generate RUN_DIR|CHECKPOINT --prompt TEXT [--max-new-tokens N] [--temperature T]
        [--top-k K] [--top-p P] [--seed S] [--kv-cache-dtype float32|bfloat16|int8|int4|int2] [key=value ...]
    jaxllm generate RUN_DIR|CHECKPOINT --chat MESSAGE [--system TEXT] | --chat-file F.jsonl
        [--out F.jsonl: the replies as a dataset] [--adapter NAME[=RUN] ...: one base, each]
        (generate, eval and convert export: [--checkpoint best|last|STEP], default last, the
        newest readable; best, the best by evaluation that checkpoint.keep_best kept)
    jaxllm plan [CONFIG.yaml] [key=value ...] [--devices N] [--hbm 80GiB] [--target tpu-v5p-8]
    jaxllm bench train [CONFIG.yaml] [key=value ...] [--steps N] [--no-compiled-flops] [--profile DIR]
    jaxllm bench data [CONFIG.yaml] [key=value ...]
    jaxllm bench comm [CONFIG.yaml] [key=value ...] [--ops OPS] [--max-bytes 16M] [--json F]
    jaxllm data tokenizer SOURCE... --vocab-size N --out DIR
    jaxllm data prepare SOURCE... --out DIR [--tokenizer T] [--workers N]
    jaxllm convert import HF_DIR OUT_DIR [key=value ...] [--peft ADAPTER_DIR]
    jaxllm convert export RUN_DIR|CHECKPOINT HF_DIR [--family NAME] [--peft | --merge]
    jaxllm quantize SRC OUT --method M [--bits B] [--group-size G] [--asymmetric] [key=value ...]
    jaxllm prune SRC OUT --method M --sparsity S | --pattern N:M [--calibration SRC] [--samples N]
    jaxllm merge OUT --method linear|task_arithmetic|ties|dare_linear|dare_ties RUN RUN...
        [--weights W1,W2,...] [--base BASE] [--density D] [--majority-sign total|frequency]
        [--seed S] [--overwrite]
    jaxllm sweep [CONFIG.yaml] [key=value ...] --grid KEY=V1,V2 [--grid ...] [--out DIR]
    jaxllm lineage RUN_OR_HF_A RUN_OR_HF_B [--reference auto|init|weights] [--alpha A] [--json F]

Exit codes, each failure with one sentence on stderr and no traceback:
  0    done; also when SIGINT / SIGTERM or train.early_stopping stopped training and a
       checkpoint was written
  1    the environment failed (read-only or full disk, a path that is a file, a directory
       removed mid-run, the run directory held by another process, JAX_PLATFORMS naming a
       platform the machine cannot start, a coordinator that does not answer), or non-finite
       steps stopped training, or `plan` found the model does not fit
  2    a mistake the user can fix (config keys, types, impossible shapes, bad data or
       checkpoints, a config file that is not a YAML mapping or gives a key twice, option values
       out of range), reported before anything is compiled or written
  130  SIGINT (143: SIGTERM) during start-up, before training ran; nothing to save; in the
       other commands (but `serve`, which finishes or cancels its requests and exits 0), SIGINT
       or SIGTERM at any point: an output being written is removed, the old one kept
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import re
import signal
import sys
import traceback
import warnings
from pathlib import Path

from jaxllm import config
from jaxllm.config import ConfigError, RunError, outputs

EXIT_ENVIRONMENT = 1
EXIT_USER_ERROR = 2


def cmd_train(ns) -> int:
    from jaxllm.train.signals import Signals

    with Signals() as signals:  # before jax is imported: a signal at any point is handled
        from jaxllm import distributed

        group = distributed.settings(ns.coordinator, ns.num_processes, ns.process_id)
        cfg = config.load_args(_bucket_run(ns.args))
        distributed.initialize(group)
        from jaxllm.train.loop import train

        result = train(cfg, signals)
    if result.get("stopped") == "nonfinite":
        print(
            f"stopped at step {result.get('step')}: non-finite loss or gradients", file=sys.stderr
        )
        return 1
    if "loss" in result:
        # cross-entropy is in nats per token; the other objectives' losses are their own
        unit = " nats/token" if cfg.train.objective in ("next_token", "sft") else ""
        said = [f"train loss {result['loss']:.3f}"]
        said += [f"eval loss {result['eval_loss']:.3f}"] if "eval_loss" in result else []
        said += [f"eval reward {result['eval_reward']:.3f}"] if "eval_reward" in result else []
        if not cfg.data.eval_sources and cfg.data.eval_fraction == 0:
            unit += "; no eval: no held-out split (data.eval_fraction=0)"
        how = {"early": "stopped early", "signal": "stopped", None: "done"}
        print(
            f"{how[result.get('stopped')]}: step {result['step']}, {', '.join(said)}{unit}",
            file=sys.stderr,
        )
    return 0


def _bucket_run(args: list[str]) -> list[str]:
    """`jaxllm train s3://BUCKET/RUN [key=value ...]`: as a local run directory stands for its
    config.yaml, a run on object storage stands for the config.yaml in the bucket (fetched),
    with `run.dir` the URL."""
    from jaxllm.config.urls import is_url

    if not args or not is_url(args[0]):
        return args
    from jaxllm import storage

    url = args[0].rstrip("/")
    return [str(storage.fetch(f"{url}/config.yaml", "run.dir")), *args[1:], f"run.dir={url}"]


def cmd_bench(ns) -> int:
    if ns.steps < 1 or ns.warmup < 0:
        raise ConfigError(
            f"--steps must be >= 1 and --warmup >= 0, not {ns.steps} and {ns.warmup}."
        )
    cfg = config.load_args(ns.args)
    from jaxllm.bench import bench_train, format_result

    result = bench_train(
        cfg,
        steps=ns.steps,
        warmup=ns.warmup,
        compiled_flops=ns.compiled_flops,
        profile_dir=ns.profile,
    )
    print(format_result(result))
    return 0


def cmd_eval(ns) -> int:
    path, overrides = config.split_args(ns.args)
    if path is None:
        raise ConfigError("jaxllm eval needs a run directory or checkpoint path.")
    from jaxllm.harness_cli import harness_eval

    if (code := harness_eval(ns)) is not None:
        return code
    if ns.chat_exact_match is not None:
        from jaxllm.infer.cli import cmd_exact_match

        return cmd_exact_match(ns)
    if ns.replies is not None:
        raise ConfigError("--replies goes with --chat-exact-match; add it.")
    from jaxllm.evaluate import evaluate_checkpoint, summary

    print(summary(evaluate_checkpoint(path, overrides, ns.batches, ns.checkpoint)))
    return 0


def cmd_plan(ns) -> int:
    cfg = config.load_args(ns.args)
    import jax

    if ns.devices and not ns.target:  # simulate the mesh's devices on the host CPU
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", ns.devices)
    from jaxllm.plan import format_plan, parse_bytes, plan, target_devices

    hbm = parse_bytes(ns.hbm) if ns.hbm else None
    devices = target_devices(ns.target) if ns.target else jax.devices()
    report = plan(cfg, devices, hbm, ns.images)
    print(format_plan(report))
    return 1 if report["fits"] is False else 0


class _Parser(argparse.ArgumentParser):
    """A mistake on the command line (an unknown option, a value not among its choices) is one
    `jaxllm:` line and exit 2, as every other mistake a user can make; `--help` shows usage."""

    def error(self, message: str):
        self.exit(2, f"jaxllm: {self.prog}: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    from jaxllm import convert_cli
    from jaxllm.harness_cli import add_harness_arguments

    p = _Parser(prog="jaxllm", description="Train LLMs with JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model (no arguments: the default run)")
    t.add_argument("args", nargs="*", metavar="CONFIG|key=value")
    t.add_argument("--coordinator", help="host:port of process 0, for multi-process runs")
    t.add_argument("--num-processes", type=int, help="processes in the run")
    t.add_argument("--process-id", type=int, help="this process's index, 0-based")
    t.set_defaults(func=cmd_train)
    ev = sub.add_parser("eval", help="loss and perplexity of a checkpoint on a dataset")
    ev.add_argument("args", nargs="+", metavar="RUN_DIR|CHECKPOINT|key=value")
    ev.add_argument("--batches", type=int, help="batches to evaluate (default train.eval_batches)")
    em = "greedy replies to a chat JSONL's conversations: accuracy against their last turn"
    ev.add_argument("--chat-exact-match", type=Path, metavar="F.jsonl", help=em)
    ev.add_argument("--replies", type=Path, help="with --chat-exact-match: write them here")
    ev.add_argument("--checkpoint", default="last", help=convert_cli.CHECKPOINT_HELP)
    add_harness_arguments(ev)
    ev.set_defaults(func=cmd_eval)
    pl = sub.add_parser("plan", help="compile the train step ahead of time: memory, FLOPs")
    pl.add_argument("args", nargs="*", metavar="CONFIG|key=value")
    pl.add_argument("--devices", type=int, help="simulate this many CPU devices")
    pl.add_argument("--hbm", help="per-device memory budget, e.g. 80GiB; exit 1 if over it")
    pl.add_argument("--target", help="TPU topology to compile for, e.g. tpu-v5p-8 (needs libtpu)")
    im = "a vision model's image budget: images at model.vision.max_pixels (default: a row each)"
    pl.add_argument("--images", type=int, help=im)
    pl.set_defaults(func=cmd_plan)
    b = sub.add_parser("bench", help="measure a component")
    bsub = b.add_subparsers(dest="what", required=True)
    bt = bsub.add_parser("train", help="step time, tokens/s, FLOPs and MFU of a train step")
    bt.add_argument("args", nargs="*", metavar="CONFIG|key=value")
    bt.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    bt.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    bt.add_argument(
        "--no-compiled-flops",
        dest="compiled_flops",
        action="store_false",
        help="skip XLA's FLOP count (a second compile, of the step with its layers unrolled)",
    )
    bt.add_argument(
        "--profile",
        metavar="DIR",
        help="profile two more steps into DIR (jax.profiler, Perfetto trace) and print the "
        "device ops that took the most time",
    )
    bt.set_defaults(func=cmd_bench)
    from jaxllm.bench_comm_cli import add_bench_comm_parser
    from jaxllm.convert_cli import add_convert_parser
    from jaxllm.data.cli import add_bench_data_parser, add_data_parser
    from jaxllm.generate_cli import add_generate_parser
    from jaxllm.lineage_cli import add_lineage_parser
    from jaxllm.merge import add_merge_parser
    from jaxllm.prune import add_prune_parser
    from jaxllm.quantize import add_quantize_parser
    from jaxllm.serve.cli import add_serve_parser
    from jaxllm.sweep import add_sweep_parser

    add_bench_data_parser(bsub)
    add_bench_comm_parser(bsub)
    for add in (add_generate_parser, add_quantize_parser, add_prune_parser, add_merge_parser):
        add(sub)
    for add in (add_data_parser, add_convert_parser, add_sweep_parser, add_serve_parser):
        add(sub)
    add_lineage_parser(sub)
    return p


# Numeric options of every command, which argparse checks for type only: (argparse dest, the
# least value, what 0 means) and (dest, whether 0 is allowed) for floats, which must be finite.
# `main` checks them before the command runs. (bench train checks --steps and --warmup.)
_COUNTS = (
    ("devices", 1, ""),
    ("max_new_tokens", 1, ""),
    ("top_k", 0, "off"),
    ("kv_page_size", 0, "a contiguous cache"),
    ("batches", 1, ""),
    ("limit", 1, ""),
    ("num_fewshot", 0, "zero-shot"),
    ("workers", 0, "in this process"),
    ("shard_docs", 1, ""),
    ("max_files", 1, ""),
)
_AMOUNTS = (("temperature", True), ("seconds", False))


def check_options(ns: argparse.Namespace) -> None:
    """A ConfigError naming the first numeric option out of its range, and what it allows."""
    for dest, least, zero in _COUNTS:
        value = getattr(ns, dest, None)
        if value is not None and value < least:
            means = f" (0: {zero})" if zero else ""
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} must be at least {least}{means}, not {value}.")
    for dest, zero_ok in _AMOUNTS:
        value = getattr(ns, dest, None)
        if value is not None and not (
            math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
        ):
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(
                f"{flag} must be a finite number {'>=' if zero_ok else '>'} 0, not {value}."
            )


def _backend_failure(e: BaseException) -> str | None:
    """JAX failing to start the platforms JAX_PLATFORMS names (or a broken plugin) as one
    sentence: the machine's setup, not a bug. None for any other error. (JAX raises a
    RuntimeError, or a bare AssertionError when it skipped every platform named, e.g. `cuda`
    without a visible GPU, wherever a command first asks for devices: so here, not in each.)"""
    said = re.fullmatch(
        r"Unable to initialize backend '([^']*)': (.*?)\.?"
        r"(?: \((?:set JAX_PLATFORMS|you may need)[^()]*\))?",
        " ".join(str(e).split()),
    )
    last = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    skipped_all = isinstance(e, AssertionError) and (
        last is not None and (Path(last.filename).name, last.name) == ("xla_bridge.py", "backends")
    )
    if said is None and not skipped_all:
        return None
    import jax

    platforms = jax.config.jax_platforms
    fix = "unset JAX_PLATFORMS to use what this machine has, or set JAX_PLATFORMS=cpu"
    if said is None:
        return f"JAX_PLATFORMS={platforms}: none of these platforms is on this machine; {fix}."
    name, why = said.groups()
    if not platforms:
        return (
            f"JAX cannot start platform '{name}' ({why}); set JAX_PLATFORMS=cpu to skip it, or "
            "repair or remove its plugin."
        )
    return f"JAX_PLATFORMS={platforms}: JAX cannot start platform '{name}' here ({why}); {fix}."


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"jaxllm: warning: {message}", file=sys.stderr if file is None else file)


class _QuietLibraryRecords(logging.Filter):
    """Orbax logs every failure of a background save with its traceback, several times, and
    notes each stray directory it lists; jaxllm.checkpoint turns such a failure into one RunError
    sentence and ignores strays on purpose, so the command line drops those records. (absl names
    its own file as every record's origin, so they are told apart by content.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.exc_info is None and not str(record.msg).startswith(
            ("Metadata file does not exist", "Failed to get item metadata")
        )


def _library_coroutine(obj) -> bool:
    """Whether `obj` is a coroutine of a library's code (not jaxllm's)."""
    code = getattr(obj, "cr_code", None)
    return code is not None and "jaxllm" not in Path(code.co_filename).parts


_process_quiet = None


@contextlib.contextmanager
def _quiet_libraries():
    """jaxllm's own warnings as one line each; library records that carry a traceback from a
    background thread (and the shutdown errors of a failed save's event loop) dropped, since
    the failure reaches the command as one exception and one sentence."""
    from jaxllm.config import JaxllmWarning

    show, hook, unraisable = warnings.showwarning, sys.excepthook, sys.unraisablehook
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]

    def showwarning(message, category, *args, **kw):
        if issubclass(category, RuntimeWarning) and "was never awaited" in str(message):
            return  # a failed save's other writes, never started: the failure is reported
        (_show_warning if issubclass(category, JaxllmWarning) else show)(
            message, category, *args, **kw
        )

    def closed_loop(tp, value) -> bool:
        return tp is RuntimeError and str(value) == "Event loop is closed"

    def excepthook(tp, value, tb):
        if not closed_loop(tp, value):
            hook(tp, value, tb)

    def unraisablehook(u):
        # A checkpoint read that failed leaves Orbax's other reads of it as coroutines that
        # end with the same error when collected, each printed with its traceback (hundreds of
        # lines); the failure itself reached the command as one exception.
        if not (closed_loop(u.exc_type, u.exc_value) or _library_coroutine(u.object)):
            unraisable(u)

    quiet = _QuietLibraryRecords()
    warnings.showwarning, sys.excepthook, sys.unraisablehook = (
        showwarning,
        excepthook,
        unraisablehook,
    )
    for lg in loggers:
        lg.addFilter(quiet)
    try:
        yield
    finally:
        warnings.showwarning, sys.excepthook, sys.unraisablehook = show, hook, unraisable
        for lg in loggers:
            lg.removeFilter(quiet)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with options and `key=value` overrides in any order
    (`jaxllm plan CONFIG --devices 8 mesh.fsdp=8`): argparse stops a positional list at the
    first option, so overrides after one come back as extras and join the command's own."""
    p = parser()
    ns, extra = p.parse_known_args(argv)
    target = next((name for name in ("args", "overrides") if hasattr(ns, name)), None)
    # A command of plain positional lists (merge's runs) takes them after options too.
    loose = getattr(ns, "positionals_anywhere", False)
    stray = [a for a in extra if target is None or a.startswith("-") or not (loose or "=" in a)]
    if stray:
        p.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        setattr(ns, target, [*getattr(ns, target), *extra])
    return ns


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit code (see the module docstring)."""
    ns = parse(argv)
    with _quiet_libraries():
        try:
            check_options(ns)
            return ns.func(ns)
        except ConfigError as e:
            print(f"jaxllm: config error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR
        except RunError as e:
            print(f"jaxllm: error: {e}", file=sys.stderr)
            return EXIT_ENVIRONMENT
        except (RuntimeError, AssertionError) as e:
            said = _backend_failure(e)
            if said is None:
                raise
            print(f"jaxllm: error: {said}", file=sys.stderr)
            return EXIT_ENVIRONMENT
        except OSError as e:  # the machine, not the user's config: one line, no traceback
            where = f": {e.filename}" if e.filename else ""
            print(f"jaxllm: error: {e.strerror or e}{where}.", file=sys.stderr)
            return EXIT_ENVIRONMENT
        except outputs.Terminated:
            print("jaxllm: terminated", file=sys.stderr)
            return 128 + signal.SIGTERM
        except KeyboardInterrupt:
            print("jaxllm: interrupted", file=sys.stderr)
            return 130


def entry() -> None:
    """The `jaxllm` program: `main`, staying quiet (as inside it) until the process ends, since
    background threads of a failed save may still report after `main` returned."""
    global _process_quiet  # held for the life of the process (a dropped one would exit)
    _process_quiet = _quiet_libraries()
    _process_quiet.__enter__()
    outputs.interrupt_on_sigterm()
    sys.exit(main())


if __name__ == "__main__":
    entry()
