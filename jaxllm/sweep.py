"""`jaxllm sweep`: train every combination of a grid of overrides and compare the runs.

    jaxllm sweep [CONFIG.yaml] [key=value ...] --grid model.position=rope,alibi,learned \\
        --grid model.norm_placement=pre,post [--out runs/sweep]

Keys joined by `+` vary together, one `+`-joined value each, e.g. equal-parameter MLPs:
`--grid model.mlp_activation+model.mlp_dim=swiglu+320,gelu+480`.

Each combination trains in `<out>/<key=value,...>/` (a normal run directory: rerunning the sweep
resumes or skips finished runs). The sweep directory then holds `results.md` and `results.csv`
(final eval loss, final train loss, median tokens/s, parameters, steps, status per run) and
`loss.png` (train loss curves of all runs, eval losses as markers). A combination the config
rejects (ConfigError) or that fails to train is reported as such and the others still run.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import statistics
import sys
from pathlib import Path

from jaxllm import config as config_lib
from jaxllm.config import ConfigError

COLUMNS = ("run", "eval_loss", "train_loss", "tokens_per_s", "params", "steps", "status")


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """['model.position=rope,alibi', ...] -> [('model.position', ['rope', 'alibi']), ...];
    'a+b=1+2,3+4' ties keys a and b (their values change together)."""
    grid = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise ConfigError(f"--grid {item!r} must look like key=value1,value2.")
        listed = [v.strip() for v in values.split(",") if v.strip()]
        if not listed:
            raise ConfigError(f"--grid {item!r} gives no values; list them after '=', with commas.")
        tied = key.count("+")
        if tied and any(v.count("+") != tied for v in listed):
            raise ConfigError(
                f"--grid {item!r} ties {tied + 1} keys with '+': give each value as "
                f"{tied + 1} parts joined by '+'."
            )
        grid.append((key.strip(), listed))
    keys = [k for key, _ in grid for k in key.split("+")]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"--grid names a key twice: {', '.join(keys)}.")
    return grid


def combinations(grid: list[tuple[str, list[str]]]) -> list[list[str]]:
    """Every combination, as a list of `key=value` overrides (the last key varies fastest; tied
    `a+b` keys give one override each)."""
    keys = [k for k, _ in grid]
    return [
        [f"{k}={v}" for key, val in zip(keys, vs) for k, v in zip(key.split("+"), val.split("+"))]
        for vs in itertools.product(*(v for _, v in grid))
    ]


def run_name(overrides: list[str]) -> str:
    """A directory name for a combination: the last part of each key with its value."""
    parts = [f"{k.split('.')[-1]}={v}" for k, _, v in (o.partition("=") for o in overrides)]
    return ",".join(parts).replace("/", "_") or "base"


@dataclasses.dataclass
class Result:
    run: str
    eval_loss: float | None = None
    train_loss: float | None = None
    tokens_per_s: float | None = None
    params: int | None = None
    steps: int | None = None
    status: str = "ok"
    curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    evals: list[tuple[int, float]] = dataclasses.field(default_factory=list)


def summarize(name: str, run_dir: Path, params: int | None) -> Result:
    """A run's numbers from its metrics.jsonl: the last eval and train losses, and the median
    tokens/s of its logged windows (compilation is outside them)."""
    from jaxllm.metrics import read_jsonl

    path = run_dir / "metrics.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    if not rows:
        return Result(name, params=params, status="no metrics")
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    return Result(
        name,
        eval_loss=evals[-1][1] if evals else None,
        train_loss=train[-1][1] if train else None,
        tokens_per_s=statistics.median(speeds) if speeds else None,
        params=params,
        steps=rows[-1]["step"],
        curve=train,
        evals=evals,
    )


def sweep(
    path: str | None, overrides: list[str], grid_items: list[str], out: str | Path, train_fn=None
) -> list[Result]:
    """Trains every combination (in-process, one after another) and writes the comparison."""
    from jaxllm.metrics import param_counts

    if train_fn is None:
        from jaxllm.train.loop import train as train_fn
    grid = parse_grid(grid_items)
    if not grid:
        raise ConfigError("jaxllm sweep needs at least one --grid key=value1,value2.")
    out = Path(out)
    results = []
    for combo in combinations(grid):
        name = run_name(combo)
        run_dir = out / name
        try:
            cfg = config_lib.load(path, [*overrides, *combo, f"run.dir={run_dir}"])
        except ConfigError as e:
            print(f"sweep: {name}: config error: {e}", file=sys.stderr)
            results.append(Result(name, status=f"config error: {e}"))
            continue
        print(f"sweep: {name} -> {run_dir}", file=sys.stderr)
        params = param_counts(cfg.model)["total"]
        try:
            outcome = train_fn(cfg)
        except ConfigError as e:
            results.append(Result(name, params=params, status=f"config error: {e}"))
            continue
        except Exception as e:  # one broken combination must not lose the others
            results.append(Result(name, params=params, status=f"failed: {type(e).__name__}: {e}"))
            continue
        result = summarize(name, run_dir, params)
        if outcome.get("stopped"):
            result.status = f"stopped ({outcome['stopped']})"
        results.append(result)
    write_report(results, grid, out)
    return results


def _fmt(value, digits=4) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def write_report(results: list[Result], grid, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in results:
            w.writerow([getattr(r, c) if getattr(r, c) is not None else "" for c in COLUMNS])
    best = min((r.eval_loss for r in results if r.eval_loss is not None), default=None)
    lines = [
        f"Sweep over {' x '.join(f'{k} ({len(v)})' for k, v in grid)}; best eval loss in bold.",
        "",
        "| run | eval loss | train loss | tokens/s | params | steps | status |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        ev = _fmt(r.eval_loss)
        if r.eval_loss is not None and r.eval_loss == best:
            ev = f"**{ev}**"
        lines.append(
            f"| {r.run} | {ev} | {_fmt(r.train_loss)} | {_fmt(r.tokens_per_s, 0)} | "
            f"{_fmt(r.params)} | {_fmt(r.steps)} | {r.status} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _plot(results, out / "loss.png")


def _plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for i, r in enumerate(results):
        if not r.curve:
            continue
        color = f"C{i % 10}"
        ax.plot(*zip(*r.curve), color=color, label=r.run)
        if r.evals:
            ax.plot(*zip(*r.evals), "o", color=color, markersize=5)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (lines), eval loss (dots), nats/token")
    ax.grid(alpha=0.3)
    if any(r.curve for r in results):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_sweep_parser(sub) -> None:
    s = sub.add_parser("sweep", help="train a grid of overrides and compare the runs")
    s.add_argument("args", nargs="*", metavar="CONFIG|key=value")
    s.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a key and its values; repeat for a product of keys",
    )
    s.add_argument("--out", default="runs/sweep", help="sweep directory (default runs/sweep)")
    s.set_defaults(func=cmd_sweep)


def cmd_sweep(ns) -> int:
    path, overrides = config_lib.split_args(ns.args)
    results = sweep(path, overrides, ns.grid, ns.out)
    print((Path(ns.out) / "results.md").read_text())
    return 0 if all(r.status == "ok" for r in results) else 1
