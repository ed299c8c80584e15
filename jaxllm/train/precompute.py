"""The reference's log-probabilities computed once, before training (`train.precompute_reference`).

DPO and IPO read their frozen reference only through its per-token log-probabilities of the
rows' targets, log ref(t_i | t_<i) at every slot i (0 outside the loss mask). The reference does
not change, so these are a fixed function of the row: computed once they replace a reference
forward pass at every step, and the reference's weights on the device, by one float32 per slot
that comes with the batch as `ref_logps` (`jaxllm.objectives.preference` reads it when present).

Before the first step the reference, loaded as `jaxllm.train.companions` loads it
(`train.reference`, else `checkpoint.init_from`; under peft with no `train.reference` the
policy's own base with its adapters zeroed, built from the state's `frozen` as
`companions.modules` builds it), runs over every train row and every row evaluation reads, a microbatch at a time, through the same jitted
objective machinery as the live reference on the run's mesh: every process computes, the lead
writes. The results are `run_dir/reference_logps/{train,eval}.npy` (float32 [rows, L]) and
`meta.json`: the reference's record (source and content hash, or the base's record under peft)
and per split the rows' count, length and a SHA-256 of their ids and masks. A later start reuses
a split when all of that matches and computes it again otherwise (other data, another
`data.seq_len`, a deleted file); a resumed run whose reference has other weights is refused, as a
live reference is. The train loop then holds no reference at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm import adapters, sharding
from jaxllm.config import Config, RunError
from jaxllm.config.train import REFERENCE_OBJECTIVES
from jaxllm.data.pipeline import eval_batches, train_batches
from jaxllm.model import abstract_model
from jaxllm.objectives import from_config
from jaxllm.objectives.base import ObjectiveOutput, reference_logps
from jaxllm.sharding import process_rows, to_global
from jaxllm.train import companions
from jaxllm.train.console import _log
from jaxllm.train.step import BATCH_AXES, objective_value

STORE = "reference_logps"  # the folder in the run directory
META = "meta.json"


def _reference_objective(model, batch: dict, rng, others) -> ObjectiveOutput:
    """The reference's per-token log-probabilities [B, L] as the metric `ref_logps`, in the rows'
    own slot order: `batch["slots"]` (0 .. L-1 per row) undoes any reordering of the length axis
    (ring attention's zigzag layout) before they are stored."""
    ref_BxL = reference_logps(others["reference"], batch)
    order_BxL = jnp.argsort(batch["slots"], axis=1)
    zero = jnp.zeros((), jnp.float32)
    return ObjectiveOutput(zero, zero, {"ref_logps": jnp.take_along_axis(ref_BxL, order_BxL, 1)})


_reference_objective.others = ("reference",)


def fingerprint(rows, n: int) -> str:
    """SHA-256 over the first `n` rows' fields (names, dtypes and values): which rows the stored
    log-probabilities belong to."""
    h = hashlib.sha256()
    for i in range(n):
        for k, v in sorted(rows[i].items()):
            v = np.ascontiguousarray(v)
            h.update(f"{k}:{v.dtype.str}:{v.shape}".encode())
            h.update(v.tobytes())
    return h.hexdigest()


class WithReference:
    """Rows whose dicts gain `ref_logps`, float32 [L], the reference's log-probabilities of the
    row's targets; the first `len(logps_NxL)` rows of `rows`. Pickles by path, not by value, so
    Grain's worker processes map the stored file instead of copying it."""

    def __init__(self, rows, logps_NxL: np.ndarray, path: Path | None = None):
        self.rows, self.logps_NxL, self.path = rows, logps_NxL, path
        self.num_docs, self.num_tokens = rows.num_docs, rows.num_tokens

    def __len__(self) -> int:
        return len(self.logps_NxL)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        row = dict(self.rows[int(index)])
        row["ref_logps"] = np.array(self.logps_NxL[int(index)], np.float32)
        return row

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.path is not None:
            state["logps_NxL"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.logps_NxL is None:
            self.logps_NxL = np.load(self.path, mmap_mode="r")


def reference_forward(cfg: Config, held: dict, mesh):
    """A jitted (params, frozen, model_state, others, batch) -> [B, L] log-probabilities of the
    reference in `held` (`companions.resolve_others`), replicated, built as the step builds its
    objective's frozen models; `batch` carries `slots` (see `_reference_objective`)."""
    graphdef = abstract_model(cfg.model, cfg.peft)[0]
    other_graphdefs = companions.graphdefs(held)
    settings = sharding.Parallel.of(mesh, cfg.mesh)

    def forward(params, frozen, model_state, others, batch):
        with sharding.active(settings):
            batch = jax.tree.map(lambda x: sharding.constrain(x, BATCH_AXES), batch)
            _, out = objective_value(
                params,
                batch,
                None,
                graphdef=graphdef,
                objective=_reference_objective,
                model_state=model_state,
                frozen=frozen,
                others=others,
                other_graphdefs=other_graphdefs,
            )
        return out.metrics["ref_logps"]

    return jax.jit(forward, out_shardings=NamedSharding(mesh, PartitionSpec()))


def kl_reference(cfg: Config, mesh):
    """`reference_forward` of the reference RLOO and REINFORCE++ read when they make a batch
    (the KL in their reward, beta > 0); None for every other run."""
    if not (cfg.train.objective in ("rloo", "reinforce_pp") and cfg.train.beta):
        return None
    return reference_forward(cfg, companions.resolve_others(cfg, from_config(cfg)), mesh)


class ReferenceLogps:
    """The precomputation of one run: `of(cfg)` resolves the reference (a ConfigError before
    anything is loaded or written), `attach` computes or reuses the log-probabilities and gives
    the batches that carry them."""

    def __init__(self, cfg: Config, held: dict):
        self.cfg, self.held = cfg, held
        self.dir = Path(cfg.run.dir) / STORE

    @classmethod
    def of(cls, cfg: Config) -> ReferenceLogps | None:
        """None unless `train.precompute_reference` is set for an objective with a reference."""
        if not (cfg.train.precompute_reference and cfg.train.objective in REFERENCE_OBJECTIVES):
            return None
        return cls(cfg, companions.resolve_others(cfg, _reference_objective))

    def record(self) -> dict:
        """What the reference is: its source and content hash, or under peft the base's record
        (`adapters.base_record`: the reference is the base with the adapters off)."""
        if self.held["reference"].source is None:
            return {"base": adapters.base_record(self.cfg)}
        return companions.records(self.held)["reference"]

    def _forward(self, mesh):
        return reference_forward(self.cfg, self.held, mesh)

    def _compute(self, forward, weights, rows, n: int, mesh, path: Path) -> np.ndarray:
        """[n, L] log-probabilities of rows 0 .. n-1, a microbatch of rows per call (the last
        one filled with rows from the start); the lead writes them to `path`."""
        size = self.cfg.train.global_batch_size // self.cfg.train.grad_accum_steps
        batch_sh = sharding.named(mesh, BATCH_AXES)
        local = process_rows(batch_sh, size)
        length = self.cfg.data.seq_len
        lead = jax.process_index() == 0
        tmp = path.with_suffix(".tmp.npy")
        if lead:
            out_NxL = np.lib.format.open_memmap(tmp, "w+", np.float32, (n, length))
        else:
            out_NxL = np.empty((n, length), np.float32)
        for start in range(0, n, size):
            items = [rows[(start + r) % n] for r in range(local.start, local.stop)]
            batch = {k: np.stack([it[k] for it in items]) for k in items[0]}
            batch["slots"] = np.broadcast_to(np.arange(length), (len(items), length))
            got_BxL = forward(*weights, to_global(batch, batch_sh, size))
            keep = min(size, n - start)
            out_NxL[start : start + keep] = np.asarray(got_BxL.addressable_data(0))[:keep]
        if lead:
            out_NxL.flush()
            del out_NxL
            os.replace(tmp, path)
            return np.load(path, mmap_mode="r")
        return out_NxL

    def attach(self, state, start: int, rows: tuple, batches, mesh):
        """(train batches, eval batches) whose rows carry `ref_logps`: computed now, or read from
        the run directory when stored for the same reference and rows. `batches` is the loop's
        train iterator, whose position the new one takes over."""
        cfg, lead = self.cfg, jax.process_index() == 0
        gbs = cfg.train.global_batch_size
        train_rows, eval_rows = rows
        counts = {
            "train": len(train_rows),
            "eval": 0 if eval_rows is None else min(cfg.train.eval_batches * gbs, len(eval_rows)),
        }
        record = self.record()
        meta_path = self.dir / META
        stored = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if jax.process_count() > 1:  # all have read it before the lead may change it
            multihost_utils.sync_global_devices("reference_logps: meta read")
        if start > 0 and stored and stored["reference"] != record:
            raise RunError(
                f"this run trained against the reference log-probabilities of {stored['reference']}"
                f", but its config now gives {record}; restore that reference, or start a new "
                "run.dir."
            )
        meta = {"reference": record}
        logps, forward, weights = {}, None, None
        for split, split_rows in (("train", train_rows), ("eval", eval_rows)):
            if split_rows is None:  # no held-out split (data.eval_fraction=0)
                continue
            t0 = time.perf_counter()
            n, path = counts[split], self.dir / f"{split}.npy"
            meta[split] = {"rows": n, "seq_len": cfg.data.seq_len}
            meta[split]["sha256"] = fingerprint(split_rows, n)
            if stored.get("reference") == record and stored.get(split) == meta[split]:
                if path.is_file():
                    logps[split] = np.load(path, mmap_mode="r")
                    _log(f"reference log-probabilities: {n} {split} rows reused from {path}")
                    continue
            if forward is None:  # the reference, held only while it computes
                if lead:
                    self.dir.mkdir(parents=True, exist_ok=True)
                    meta_path.unlink(missing_ok=True)  # the files change: not valid until done
                forward = self._forward(mesh)
                held = companions.load(self.held, mesh)
                weights = (state.params, state.frozen, state.model_state, held)
            logps[split] = self._compute(forward, weights, split_rows, n, mesh, path)
            _log(
                f"reference log-probabilities: {n} {split} rows computed in "
                f"{time.perf_counter() - t0:.1f}s -> {path}"
            )
        if lead and forward is not None:
            tmp = meta_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(meta, indent=2) + "\n")
            os.replace(tmp, meta_path)
        with_ref = {
            s: WithReference(r, logps[s], self.dir / f"{s}.npy" if lead else None)
            for s, r in (("train", train_rows), ("eval", eval_rows))
            if r is not None
        }
        local = process_rows(sharding.named(mesh, BATCH_AXES), gbs)
        new = train_batches(with_ref["train"], cfg.data, gbs, local)
        new.set_state(batches.get_state())
        batches.close()
        return new, eval_batches(with_ref.get("eval"), gbs, cfg.train.eval_batches, local)
