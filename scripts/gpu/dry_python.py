"""A stand-in for `python` that checks the command lines of `scripts/gpu/run.sh` on a CPU before
a GPU run spends its time on them:

    PY="python scripts/gpu/dry_python.py" scripts/gpu/run.sh env train:dots:cudnn:4 fp8 ...

Each step's command is checked as far as it can be without running it, and the step fails as the
real one would on a bad command line:
- `SCRIPT.py ARGS`: the script's argument parser reads ARGS (argparse's exit 2 on a bad flag),
  then the stand-in exits 0 instead of running the script's work (a script of `scripts/` without
  an argparse parser fails: it has no dry form; one from elsewhere, the PyTorch peer, need only
  exist);
- `-m jaxllm bench train CONFIG OVERRIDES`: the config loads and validates, nothing compiles;
- `-m pytest ARGS`: the tests collect (`--collect-only`), and a selection of none fails (exit 5);
- `-c CODE`: the code compiles.
Everything runs on the CPU (JAX_PLATFORMS=cpu)."""

from __future__ import annotations

import argparse
import os
import runpy
import sys

os.environ["JAX_PLATFORMS"] = "cpu"  # run.sh exports cuda
SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parsed_then_exit(parse):
    def wrapped(self, *args, **kwargs):
        parse(self, *args, **kwargs)
        raise SystemExit(0)  # the command line is good: the script's work is not done

    return wrapped


def _script(path: str, args: list[str]) -> None:
    if not os.path.isfile(path):
        sys.exit(f"dry run: no script {path}")
    if os.path.dirname(os.path.abspath(path)) not in (SCRIPTS, os.path.join(SCRIPTS, "gpu")):
        return  # another project's script (the PyTorch peer): present is all that is checked
    if "argparse" not in open(path).read():
        sys.exit(f"dry run: {path} reads no argparse command line, so it has no dry form")
    argparse.ArgumentParser.parse_args = _parsed_then_exit(argparse.ArgumentParser.parse_args)
    sys.argv = [path, *args]
    runpy.run_path(path, run_name="__main__")
    sys.exit(f"dry run: {path} parsed no arguments (its command line is unchecked)")


def _jaxllm(args: list[str]) -> None:
    if args[:2] != ["bench", "train"]:
        sys.exit(f"dry run: `jaxllm {' '.join(args[:2])}` has no dry form here")
    import jaxllm.bench
    from jaxllm.cli import main

    def validated(cfg, **_):  # cmd_bench has loaded and validated the config
        raise SystemExit(0)

    jaxllm.bench.bench_train = validated
    sys.exit(main(args))


def main(argv: list[str]) -> None:
    if argv[:1] == ["-c"]:
        compile(argv[1], "<run.sh -c>", "exec")
    elif argv[:2] == ["-m", "pytest"]:
        import pytest

        sys.exit(pytest.main([*argv[2:], "--collect-only"]))
    elif argv[:2] == ["-m", "jaxllm"]:
        _jaxllm(argv[2:])
    elif argv and argv[0].endswith(".py"):
        _script(argv[0], argv[1:])
    else:
        sys.exit(f"dry run: no dry form for `python {' '.join(argv)}`")


if __name__ == "__main__":
    main(sys.argv[1:])
