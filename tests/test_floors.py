"""The import floors of the house, read from the source (no imports run):

    config -> storage -> data, sharding, checkpoint, optim, metrics, trackers, distributed
    -> kernels -> parallel -> model -> compress -> infer, convert -> load -> adapters ->
    objectives -> train -> evaluate, plan, quantize, bench, sweep -> cli

A module imports only from its own floor's package or from floors below; nothing imports
upward, there are no circles, and a function-level import of a jaxllm module appears only where
it defers something on purpose (listed below with the reason)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (floor, package or module prefix); the most specific prefix wins
FLOORS = [
    (0, "jaxllm.config"),
    (0.5, "jaxllm.storage"),
    (
        0.75,
        "jaxllm.blockwise",
    ),  # blockwise 8-bit codes: the 8-bit optimizer's and checkpoints'  # object storage: between the config and the base floor
    (1, "jaxllm.data"),
    (1, "jaxllm.sharding"),
    (1, "jaxllm.checkpoint"),
    (1, "jaxllm.optim"),
    (1, "jaxllm.metrics"),
    (1, "jaxllm.hlo_collectives"),
    (1, "jaxllm.trackers"),
    (1, "jaxllm.distributed"),
    (2, "jaxllm.kernels"),
    (3, "jaxllm.parallel"),
    (4, "jaxllm.model"),
    (4.5, "jaxllm.compress"),  # quantization methods over the model's quantized tensors
    (5, "jaxllm.infer"),
    (5, "jaxllm.convert"),
    (6, "jaxllm.load"),
    (7, "jaxllm.adapters"),
    (8, "jaxllm.objectives"),
    (9, "jaxllm.train"),
    (10, "jaxllm.evaluate"),
    (10, "jaxllm.harness"),
    (10, "jaxllm.plan"),
    (9.5, "jaxllm.plan_vision"),  # the vision tower's bill, which plan reads
    (10, "jaxllm.quantize"),
    (10.5, "jaxllm.prune"),  # the pruning command, which reads runs as quantize does
    (10, "jaxllm.bench"),
    (10, "jaxllm.bench_comm"),
    (10, "jaxllm.sweep"),
    (10, "jaxllm.lineage"),
    (11, "jaxllm.cli"),
    (11, "jaxllm.data.cli"),
    (11, "jaxllm.infer.cli"),
    (11, "jaxllm.convert_cli"),
    (11, "jaxllm.bench_comm_cli"),
    (11, "jaxllm.generate_cli"),
    (11, "jaxllm.lineage_cli"),
    (11, "jaxllm.harness_cli"),
    (11, "jaxllm"),  # the package root names the public pieces
    (11, "jaxllm.__main__"),
]

# module -> why its function-level imports of jaxllm modules are there
DEFERRED = {
    "jaxllm.cli": "a subcommand's modules (and jax) load only when it runs, after the signal "
    "handlers are installed, so `jaxllm --help` is instant and Ctrl-C in start-up exits 130",
    "jaxllm.data.cli": "the data commands' modules (and jax) load only when one runs: the "
    "parser, built for every command, imports this module",
    "jaxllm.sweep": "the training stack (and jax) loads only when a sweep runs: the parser, "
    "built for every command, imports this module",
    "jaxllm.bench_comm_cli": "the collectives' modules (and jax) load only when `bench comm` "
    "runs, after the process group is joined: the parser, built for every command, imports it",
    "jaxllm.generate_cli": "the generation stack (and jax) loads only when `generate` runs: "
    "the parser, built for every command, imports this module",
    "jaxllm.lineage_cli": "the model stack (and jax) loads only when `lineage` runs: the "
    "parser, built for every command, imports this module",
    "jaxllm.harness_cli": "lm-evaluation-harness and the model stack (and jax) load only when "
    "`eval --harness` runs: the parser, built for every command, imports this module",
    "jaxllm.serve.cli": "the model stack, FastAPI and uvicorn (and jax) load only when the "
    "server runs: the parser, built for every command, imports this module",
    "jaxllm.kernels.flash_attention.ops": "a backend (Triton, Mosaic) loads only when used",
    "jaxllm.kernels.decode_attention.ops": "a backend (Triton, Mosaic) loads only when used",
    "jaxllm.kernels.int4_matmul.ops": "the Triton backend loads only when used",
    "jaxllm.kernels.gated_delta.ops": "the Pallas backend loads only when used",
    "jaxllm.model.delta_rule": "the gated delta rule's Pallas kernel loads only when a call "
    "asks for it (kernel=True); the XLA form needs nothing from jaxllm.kernels",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "jaxllm").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        parts = ("jaxllm", *path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _floor(module: str) -> tuple[int, str]:
    """(floor, the package it belongs to); the top floor is one package, the command line."""
    best = max((p for _, p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    floor = dict((p, f) for f, p in FLOORS)[best]
    return floor, "command line" if floor == FLOORS[-1][0] else best


def _imports(path: Path, module: str):
    """(imported jaxllm module, line, at module level?) for every import in the file."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    top |= {id(n) for s in tree.body if isinstance(s, ast.If | ast.Try) for n in ast.walk(s)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [(a.name, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            names = [(f"{base}.{a.name}", base) for a in node.names]
        else:
            continue
        for name, base in names:
            if base == "jaxllm" or base.startswith("jaxllm."):
                yield name, base, node.lineno, id(node) in top


def _edges():
    modules = _modules()
    for module, path in modules.items():
        seen = set()
        for name, base, line, top in _imports(path, module):
            # `from jaxllm.x import y` imports module jaxllm.x.y when y is one, else jaxllm.x
            target = name if name in modules else base
            if target in modules and target != module and (target, line) not in seen:
                seen.add((target, line))
                yield module, target, f"{path.relative_to(ROOT)}:{line}", top


def test_no_import_runs_up_a_floor():
    upward = []
    for src, dst, where, _ in _edges():
        (fs, ps), (fd, pd) = _floor(src), _floor(dst)
        if fd > fs or (fd == fs and ps != pd):
            upward.append(f"{where}: {src} (floor {fs}) imports {dst} (floor {fd})")
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in _edges():
        graph.setdefault(src, set()).add(dst)
    # a module importing its own package's __init__ (and back) is Python's package mechanics
    graph = {
        m: {d for d in ds if not m.startswith(d + ".") and not d.startswith(m + ".")}
        for m, ds in graph.items()
    }
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                circles.append(sorted(scc))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_function_level_imports_only_defer_on_purpose():
    hidden = [
        f"{where}: {src} imports {dst} inside a function"
        for src, dst, where, top in _edges()
        if not top and src not in DEFERRED
    ]
    assert not hidden, "\n".join(hidden)


@pytest.mark.parametrize("module", sorted(DEFERRED))
def test_the_deferring_modules_exist(module):
    assert module in _modules()


def test_files_stay_readable_in_one_sitting():
    """No module of the package or the kernels over 450 lines, no test file over 400: a file
    past that holds more than one subject and is split by subject."""
    limits = {"jaxllm": 450, "kernels": 450, "tests": 400}
    over = [
        f"{path.relative_to(ROOT)} ({n} lines > {limit})"
        for top, limit in limits.items()
        for path in sorted((ROOT / top).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > limit
    ]
    assert not over, over
