"""`jaxllm merge OUT --method M RUN...`: several fine-tunes of one model merged into one run.

The methods, on the runs' weights theta_1..theta_n (every parameter, each a tensor), with
weights w_i (`--weights`) and, except for `linear`, the base theta_0 (`--base`) they were
fine-tuned from, whose task vectors are tau_i = theta_i - theta_0:

- `linear` (model soups, Wortsman et al. 2022): theta = sum_i w_i theta_i, w_i = 1/n by default.
- `task_arithmetic` (Ilharco et al. 2023): theta = theta_0 + sum_i w_i tau_i, w_i = 1 by default.
- `ties` (Yadav et al. 2023): each tau_i keeps its top `density` fraction by magnitude (trim);
  the sign of sum_i tau_i elects, per element, a majority sign (`--majority-sign total`; with
  `frequency`, the sign of the count of positive minus negative entries); the merged task
  vector is, per element, the mean of the w_i tau_i whose sign agrees with it (disjoint merge).
- `dare_linear` (Yu et al. 2024, DARE): each tau_i keeps each element with probability
  `density` (a Bernoulli mask from `--seed`), rescaled by 1 / density; then as task_arithmetic.
- `dare_ties`: DARE's random drop and rescale, then TIES's sign election and disjoint merge.

These are Hugging Face PEFT's definitions (`peft.utils.merge_utils`; the tests compare against
it on the same tensors): the weights w_i multiply the task vectors after sign election, which
uses the unweighted ones. The math is `merge_stacked`, pure JAX on a [n, ...] stack.

A LoRA (or QLoRA) run enters as its merged model W + s A B (`jaxllm.load.load_weights`), and
runs that are all LoRA runs on one base need no `--base`: their base is the one they record.
Merging the weights rather than the adapters is exact for every method (TIES and DARE act on
the per-weight delta s A B, which is no low-rank product once trimmed), so OUT is always a full
run: config.yaml (the first run's, without its peft), its tokenizer's files, a weights-only
checkpoint at step 0, and merge.json recording the method, runs, base, weights, density,
majority sign and seed. `eval`, `generate`, `load_model` and `convert export` read it.

Every check runs before any weight is read: the method and its options, OUT (no files in it
without --overwrite, nor one of the runs), the runs' parameter shapes, and their bases (LoRA
runs trained on other bases are refused). OUT appears only when complete.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxllm import checkpoint, sharding
from jaxllm import config as config_lib
from jaxllm.config import Config, ConfigError, PeftConfig
from jaxllm.convert.hf import NewRun, check_out_dir
from jaxllm.load import (
    BASE_ITEM,
    _is_hf_source,
    fetched,
    load_weights,
    merged_weights,
    resolve,
    restore,
    weight_targets,
)
from jaxllm.model import abstract_model
from jaxllm.quantize import _tokenizer_files, _with_tokenizer

__all__ = [
    "METHODS",
    "PROVENANCE",
    "RANDOM",
    "SIGNED",
    "SPARSE",
    "Plan",
    "dare_masks",
    "disjoint_merge",
    "magnitude_mask",
    "majority_sign_mask",
    "merge_params",
    "merge_runs",
    "merge_stacked",
    "plan",
]

METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties")
SPARSE = ("ties", "dare_linear", "dare_ties")  # take --density
SIGNED = ("ties", "dare_ties")  # take --majority-sign
RANDOM = ("dare_linear", "dare_ties")  # take --seed
PROVENANCE = "merge.json"


# ---- the math: pure functions of a stack of task tensors [n, ...] --------------------------


def magnitude_mask(t: jax.Array, density: float) -> jax.Array:
    """1 on the k = floor(density * size) largest |t| entries of one tensor, else 0 (TIES's
    trim; PEFT's `magnitude_based_pruning`)."""
    flat = jnp.abs(t).reshape(-1)
    k = int(density * flat.size)
    _, idx = jax.lax.top_k(flat, k)
    return jnp.zeros_like(flat).at[idx].set(1).reshape(t.shape)


def dare_masks(key: jax.Array, shape: tuple[int, ...], density: float) -> jax.Array:
    """Bernoulli(density) keep-masks, one per task tensor of the stack `shape` [n, ...]."""
    return jax.random.bernoulli(key, density, shape).astype(jnp.float32)


def majority_sign_mask(stack: jax.Array, method: str = "total") -> jax.Array:
    """Where each task tensor's sign agrees with the elected one: sign(sum_i tau_i)
    (`total`) or sign(sum_i sign(tau_i)) (`frequency`), zero counting as positive."""
    sign = jnp.sign(stack)
    votes = stack.sum(0) if method == "total" else sign.sum(0)
    return sign == jnp.where(votes >= 0, 1.0, -1.0)[None]


def disjoint_merge(weighted: jax.Array, agree: jax.Array) -> jax.Array:
    """Per element, the mean of the entries whose sign agrees: sum_i a_i x_i / max(sum_i a_i, 1)."""
    kept = (weighted * agree).sum(0)
    return kept / jnp.maximum(agree.sum(0), 1.0)


def merge_stacked(
    method: str,
    stack: jax.Array,
    weights: jax.Array,
    density: float = 1.0,
    majority_sign: str = "total",
    keep: jax.Array | None = None,
) -> jax.Array:
    """The merge of `stack` [n, ...] (the runs' weights for `linear`, else their task vectors)
    with `weights` [n]. `keep`: DARE's keep-masks [n, ...] (`dare_masks`); density >= 1
    drops nothing (as PEFT's `prune`)."""
    stack = stack.astype(jnp.float32)
    w = weights.astype(jnp.float32).reshape((-1,) + (1,) * (stack.ndim - 1))
    if density < 1 and method == "ties":
        stack = jnp.stack([t * magnitude_mask(t, density) for t in stack])
    if density < 1 and method in RANDOM:
        stack = stack * keep / density
    if method in SIGNED:
        return disjoint_merge(stack * w, majority_sign_mask(stack, majority_sign))
    return (stack * w).sum(0)


# ---- the command --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked merge: its method and options, and what to read."""

    method: str
    runs: tuple[Path, ...]
    base: str | None  # --base, or None: the LoRA runs' own base (or none for linear)
    weights: tuple[float, ...]
    density: float | None
    majority_sign: str | None
    seed: int | None

    def record(self) -> dict:
        """merge.json: what OUT was merged from, and how."""
        out = {"method": self.method, "runs": [str(r.resolve()) for r in self.runs]}
        out["base"] = self.base if self.base is None or _is_url(self.base) else _abs(self.base)
        out["weights"] = list(self.weights)
        for key in ("density", "majority_sign", "seed"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def _is_url(s: str) -> bool:
    return "://" in s


def _abs(s: str) -> str:
    return str(Path(s).resolve())


def plan(method, runs, *, weights=None, base=None, density=None, majority_sign=None, seed=None):
    """The checked `Plan` of the options (ConfigError for a bad one); reads no weights."""
    if method not in METHODS:
        raise ConfigError(
            f"--method {method} is not a merge method jaxllm has; it has {', '.join(METHODS)}."
        )
    if len(runs) < 2:
        raise ConfigError("jaxllm merge takes OUT and at least two runs to merge.")
    for flag, value, takes in (
        ("--density", density, SPARSE),
        ("--majority-sign", majority_sign, SIGNED),
        ("--seed", seed, RANDOM),
    ):
        if value is not None and method not in takes:
            raise ConfigError(f"{flag} is for --method {' or '.join(takes)}, not {method}.")
    if method == "linear" and base is not None:
        raise ConfigError("--method linear averages the runs' weights and takes no --base.")
    if weights is None:
        weights = (1 / len(runs),) * len(runs) if method == "linear" else (1.0,) * len(runs)
    if len(weights) != len(runs):
        raise ConfigError(f"--weights gives {len(weights)} weights for {len(runs)} runs.")
    if method in SPARSE:
        density = 0.5 if density is None else density
        if not 0 < density <= 1:
            raise ConfigError(f"--density {density}: the fraction kept must be in (0, 1].")
    if method in SIGNED:
        majority_sign = majority_sign or "total"
    if method in RANDOM:
        seed = 0 if seed is None else seed
    return Plan(method, tuple(Path(r) for r in runs), base, tuple(weights), density,
                majority_sign, seed)  # fmt: skip


def merge_runs(out, p: Plan, *, overwrite: bool = False) -> Path:
    """Writes the merged run OUT of the checked plan `p`. Returns OUT."""
    runs = [Path(fetched(r, "RUN")) for r in p.runs]
    out = check_out_dir(out, flag="OUT", overwrite=overwrite, reads=(*runs, p.base), nested=False)
    saved = [_run_config(r) for r in runs]
    _check_shapes(runs, saved)
    lora_base = _common_base(runs, saved, p)
    cfg = _out_config(saved[0], out)
    devices = jax.devices()
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    loaded = [load_weights(r, cfg.model, mesh) for r in runs]
    if p.method == "linear":
        base = None
    elif p.base is not None:
        base = load_weights(fetched(p.base, "--base"), cfg.model, mesh)[0]
    else:
        base = _lora_base(lora_base, cfg, mesh)
    params = merge_params(p, [w for w, _ in loaded], base)
    states = [s for _, s in loaded if s]
    model_state = jax.tree.map(lambda *x: sum(x) / len(x), *states) if states else {}
    new = _with_tokenizer(NewRun(out, cfg, out / "checkpoints", _tokenizer_files(saved[0]),
                                 overwrite))  # fmt: skip
    new.write(params, model_state, files={PROVENANCE: json.dumps(p.record(), indent=2) + "\n"})
    return out


def merge_params(p: Plan, params: list[dict], base: dict | None) -> dict:
    """Every parameter of the runs' `params` merged by `p` (task vectors against `base`), in
    the runs' dtypes and shards; DARE's masks come from `p.seed` folded with each parameter's
    index in the flattened tree, so a merge is reproducible."""
    leaves, treedef = jax.tree.flatten(params[0])
    others = [jax.tree.leaves(q) for q in params[1:]]
    base_leaves = jax.tree.leaves(base) if base is not None else [None] * len(leaves)
    weights = jnp.asarray(p.weights, jnp.float32)
    key = jax.random.key(p.seed or 0)

    @jax.jit
    def one(stack, b, k):
        keep = dare_masks(k, stack.shape, p.density) if p.method in RANDOM else None
        vectors = stack if b is None else stack - b.astype(jnp.float32)[None]
        merged = merge_stacked(p.method, vectors, weights, p.density or 1.0,
                               p.majority_sign or "total", keep)  # fmt: skip
        return merged if b is None else b.astype(jnp.float32) + merged

    out = []
    for i, (leaf, b) in enumerate(zip(leaves, base_leaves, strict=True)):
        stack = jnp.stack([leaf.astype(jnp.float32), *(o[i].astype(jnp.float32) for o in others)])
        merged = one(stack, b, jax.random.fold_in(key, i)).astype(leaf.dtype)
        out.append(jax.device_put(merged, leaf.sharding))
    return jax.tree.unflatten(treedef, out)


def _run_config(run: Path) -> Config:
    if _is_hf_source(run):
        raise ConfigError(f"{run} is a Hugging Face directory; import it first (convert import).")
    run_dir, _, _ = resolve(run)
    cfg = config_lib.load(run_dir / "config.yaml")
    if cfg.quantize.enabled:
        raise ConfigError(
            f"{run} is quantized (quantize.method={cfg.quantize.method}); merge the runs it "
            "was made from."
        )
    return cfg


def _check_shapes(runs, saved) -> None:
    """ConfigError naming the first parameter whose shape differs from the first run's."""
    first = _shapes(saved[0])
    for run, cfg in zip(runs[1:], saved[1:], strict=True):
        have = _shapes(cfg)
        if have != first:
            diff = sorted(set(first.items()) ^ set(have.items()))[0][0]
            raise ConfigError(
                f"{run} has other parameters than {runs[0]} (first: {diff}: "
                f"{have.get(diff)} there, {first.get(diff)} in {runs[0].name}); merging takes "
                "fine-tunes of one model."
            )


def _shapes(cfg: Config) -> dict:
    params = abstract_model(cfg.model)[1]
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): v.shape for path, v in flat}


def _base_of(run: Path, cfg: Config) -> dict:
    run_dir, ckpt_dir, step = resolve(run)
    ckpt_dir = ckpt_dir or checkpoint.checkpoint_dir(run_dir, cfg.checkpoint.dir)
    if step is None:  # the newest, as restore reads
        step = (checkpoint.steps(ckpt_dir) or [None])[-1]
    record = checkpoint.read_json_item(ckpt_dir, step, BASE_ITEM)
    if record is None:
        raise ConfigError(f"{ckpt_dir}/{step} has no record of its fine-tuning base.")
    return record


def _common_base(runs, saved, p: Plan) -> Path | None:
    """The LoRA run whose base every run shares, when all runs are LoRA runs (None when
    --base is given or the method needs none); ConfigError for LoRA runs on other bases, or
    task vectors with no base."""
    lora = [(r, c) for r, c in zip(runs, saved, strict=True) if c.peft.method != "none"]
    records = [(r, _base_of(r, c)) for r, c in lora]
    for run, rec in records[1:]:
        first_run, first = records[0]
        same = rec == first or (rec.get("sha256") and rec.get("sha256") == first.get("sha256"))
        if not same:
            raise ConfigError(
                f"{run} was fine-tuned on another base than {first_run} ({_describe(rec)} "
                f"there, {_describe(first)} here); merging takes fine-tunes of one base."
            )
    if p.method == "linear" or p.base is not None:
        return None
    if len(lora) != len(runs):
        raise ConfigError(
            f"--method {p.method} merges task vectors (each run minus its base); name the "
            "base the runs were fine-tuned from with --base."
        )
    return runs[0]


def _describe(record: dict) -> str:
    if "seed" in record:
        return f"random initialisation run.seed={record['seed']}"
    return f"{record['source']} sha256 {record['sha256'][:12]}"


def _lora_base(run: Path, cfg: Config, mesh) -> dict:
    """The base a LoRA run was trained on, as its merged weights with the adapters zeroed
    (B = 0 makes W + s A B = W; QLoRA's NF4 dequantized as in the run's merged model)."""
    restored = restore(run, mesh=mesh)
    zero = jax.tree.map(jnp.zeros_like, restored.params)
    _, target, _ = weight_targets(cfg.model, mesh)
    return merged_weights(restored._replace(params=zero), target)


def _out_config(saved: Config, out: Path) -> Config:
    """The first run's config as a plain model whose directories are OUT's."""
    return dataclasses.replace(
        saved,
        peft=PeftConfig(),
        run=dataclasses.replace(saved.run, dir=str(out)),
        checkpoint=dataclasses.replace(saved.checkpoint, dir=None, init_from=None),
    )


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--weights {text}: give numbers separated by commas.") from None


def cmd_merge(ns) -> int:
    out, *runs = ns.args
    p = plan(
        ns.method,
        runs,
        weights=_floats(ns.weights) if ns.weights is not None else None,
        base=ns.base,
        density=ns.density,
        majority_sign=ns.majority_sign,
        seed=ns.seed,
    )
    merge_runs(out, p, overwrite=ns.overwrite)
    print(f"merged {len(runs)} runs ({p.method}) into {out}", file=sys.stderr)
    return 0


def add_merge_parser(sub) -> None:
    m = sub.add_parser("merge", help="merge fine-tunes of one model into a new run")
    m.add_argument("args", nargs="+", metavar="OUT RUN")
    m.add_argument("--method", required=True, help=", ".join(METHODS))
    m.add_argument("--weights", help="one weight per run, comma-separated")
    m.add_argument("--base", help="the run the runs were fine-tuned from (task vectors)")
    m.add_argument("--density", type=float, help="fraction of each task vector kept (0.5)")
    m.add_argument("--majority-sign", choices=("total", "frequency"), help="TIES's sign vote")
    m.add_argument("--seed", type=int, help="DARE's random drop (default 0)")
    m.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    m.set_defaults(func=cmd_merge, positionals_anywhere=True)
