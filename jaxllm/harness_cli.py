"""`jaxllm eval RUN_DIR --harness TASKS [--include-path DIR] [--limit N] [--num-fewshot K]`:
the options, their checks and the dispatch; lm-evaluation-harness (`jaxllm.harness`) is
imported only when `--harness` runs."""

from __future__ import annotations

from pathlib import Path

from jaxllm.config import ConfigError

_ONLY_WITH = ("include_path", "limit", "num_fewshot")


def add_harness_arguments(ev) -> None:
    """`jaxllm eval`'s --harness options on its parser `ev`."""
    hm = "lm-evaluation-harness tasks, comma-separated (names, globs or task YAML files)"
    ev.add_argument("--harness", metavar="TASKS", help=hm)
    ev.add_argument("--include-path", type=Path, metavar="DIR", help="with --harness: task YAMLs")
    ev.add_argument("--limit", type=int, help="with --harness: at most N examples per task")
    ev.add_argument("--num-fewshot", type=int, help="with --harness: few-shot examples")


def harness_eval(ns) -> int | None:
    """Runs `--harness` and returns its exit code; None when `ns` has no --harness."""
    if ns.harness is None:
        if any(getattr(ns, k) is not None for k in _ONLY_WITH):
            raise ConfigError(
                "--include-path, --limit and --num-fewshot go with --harness; add it."
            )
        return None
    if ns.chat_exact_match is not None or ns.batches is not None:
        raise ConfigError("--harness runs lm_eval's tasks; drop --chat-exact-match and --batches.")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--harness needs lm-evaluation-harness: pip install 'jaxllm[harness]'"
        ) from None
    from jaxllm.harness import cmd_harness

    return cmd_harness(ns)
