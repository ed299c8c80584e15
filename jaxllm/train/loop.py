"""The host loop of `jaxllm train`.

It respects asynchronous dispatch: step n is launched before step n-1's metrics are read, so the
device always has the next step queued while the host logs, and NaN checks run on that delayed
copy. Outputs go to `run.dir`: config.yaml, metrics.jsonl, tensorboard/, loss.png, checkpoints/,
and to the trackers of `run.trackers` (`jaxllm.trackers`: W&B, MLflow).

Start-up does everything that can fail (config, data, the run directory's paths, whether its
checkpoints fit this config) before it writes anything; then it locks the directory
(`run_dir.RunLock`), restores or initialises the state, and only then writes config.yaml. A
command that fails at start-up leaves the run directory exactly as it was. At the end the final
checkpoint is written before the optional outputs (loss plot, sample).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
import warnings
from pathlib import Path

import jax

from jaxllm import adapters, checkpoint, config, sharding, storage, trackers
from jaxllm.checkpoint import mirror
from jaxllm.config import JaxllmWarning
from jaxllm.config.train import ROLLOUT_OBJECTIVES
from jaxllm.data import check_vocab
from jaxllm.data.objective_rows import row_transform
from jaxllm.data.pipeline import eval_batches, train_batches
from jaxllm.data.span_corruption import corrupted_splits
from jaxllm.data.tokenizer import make_tokenizer
from jaxllm.load import fetched_inputs
from jaxllm.metrics import MetricsWriter, plot_losses
from jaxllm.objectives.rollout import onpolicy
from jaxllm.objectives.rollout.sampling import Rollouts, next_rows
from jaxllm.sharding import process_rows, to_global
from jaxllm.train import companions, loss_scale, precompute, remat_auto, watch
from jaxllm.train.compiled import check_param_groups, compile_steps, evaluate
from jaxllm.train.console import _log, _Plain, _progress, _show, parameter_line, sample
from jaxllm.train.run_dir import (
    RunLock,
    check_paths,
    check_resume,
    let_go,
    move_aside,
    move_back,
    optimizer_change,
    pull_remote,
    recorded,
    staged,
)
from jaxllm.train.signals import Signals
from jaxllm.train.start import start_state
from jaxllm.train.state import on_device
from jaxllm.train.vision import run_splits


def train(cfg: config.Config, signals: Signals | None = None) -> dict:
    """Runs (or resumes) the configured training; returns the last logged metrics, plus `stopped`
    ('signal', 'nonfinite', or 'early' for `train.early_stopping`) when the run ended early.
    `signals` (the CLI passes its own, set up before jax is imported) decides what SIGINT /
    SIGTERM do; by default a fresh one."""
    with contextlib.ExitStack() as stack:
        if signals is None:
            signals = stack.enter_context(Signals())
        try:
            return _train(cfg, signals)
        except (config.ConfigError, config.RunError) as e:
            if not storage.is_url(cfg.run.dir):
                raise
            staging = str(mirror.staging_dir(cfg.run.dir.rstrip("/")))
            if staging not in str(e):
                raise
            raise type(e)(str(e).replace(staging, cfg.run.dir.rstrip("/"))) from None


def _train(cfg: config.Config, signals: Signals) -> dict:
    devices = jax.devices()
    cfg.validate(len(devices))
    check_vocab(cfg.data, cfg.model.vocab_size)
    trackers.check(cfg.run)  # the W&B / MLflow packages, before anything is written
    mesh = sharding.make_mesh(cfg.mesh, devices)
    asked = cfg  # what config.yaml records: URLs as given, not their local copies
    url, cfg = staged(cfg)  # run.dir on object storage: trains in its staging dir
    cfg = fetched_inputs(cfg)  # models and a tokenizer in a bucket: read from local copies
    cfg = adapters.quantized_base(cfg)  # LoRA on a quantized run: its quantize section
    cfg = adapters.pruned_base(cfg)  # from a pruned run: its zeros stay zero
    cfg = companions.with_features(cfg)  # feature distillation: layer pairs, projections
    asked = dataclasses.replace(asked, quantize=cfg.quantize, prune=cfg.prune, peft=cfg.peft)
    run_dir = Path(cfg.run.dir)
    ckpt_dir = checkpoint.checkpoint_dir(run_dir, cfg.checkpoint.dir)
    lead = jax.process_index() == 0  # writes the run's files; every process computes
    check_param_groups(cfg)  # a group's regex matching no parameter: refused before any file
    where = f"{url} (staged in {run_dir.resolve()})" if url else run_dir.resolve()
    _log(f"run dir: {where}")
    _log(
        f"mesh: {dict(mesh.shape)} on {len(devices)} {devices[0].platform} device(s)"
        + (f" in {jax.process_count()} processes" if jax.process_count() > 1 else "")
    )

    cfg = remat_auto.resolve(cfg, mesh, log=_log)  # model.remat=auto: config.yaml says which
    jit_train, jit_eval, tx, shardings, batch_sh = compile_steps(cfg, mesh)  # checks shapes
    reference = precompute.ReferenceLogps.of(cfg)  # None unless train.precompute_reference
    t0 = time.perf_counter()
    gbs = cfg.train.global_batch_size
    local = process_rows(batch_sh, gbs)
    if cfg.train.objective in ROLLOUT_OBJECTIVES:  # the policy samples its own batches
        batches = Rollouts(cfg, mesh, batch_sh, local, precompute.kl_reference(cfg, mesh))
        held_out = []
        _log(f"data: {len(batches.prompts)} rollout prompts, {len(batches.eval_prompts)} eval")
    else:
        if cfg.train.objective == "span_corruption":  # encoder inputs, decoder targets
            train_rows, eval_rows = corrupted_splits(cfg.data, cfg.model.vocab_size)
        else:
            train_rows, eval_rows = run_splits(cfg)  # reward's closing slots, images
        sources = ", ".join(src.path for src in cfg.data.sources)
        _log(
            f"data: {sources}: {train_rows.num_docs:,} train documents, "
            f"{train_rows.num_tokens:,} tokens, {len(train_rows):,} rows of {cfg.data.seq_len}; "
            f"{'no' if eval_rows is None else f'{eval_rows.num_docs:,}'} eval documents "
            f"({time.perf_counter() - t0:.1f}s)"
        )
        if eval_rows is None:
            _log(
                "eval: none, no held-out split (data.eval_fraction=0 and no data.eval_sources); "
                "train.eval_every does nothing"
            )
        rewrite = row_transform(cfg, make_tokenizer(cfg.data))  # mlm / prefix_lm; else None
        batches = train_batches(train_rows, cfg.data, gbs, local, rewrite)
        batches = onpolicy.wrap(cfg, mesh, local, train_rows, batches)  # some sampled (GKD)
        held_out = eval_batches(eval_rows, gbs, cfg.train.eval_batches, local, rewrite)

    # The run directory: checked, then locked; nothing was written before this point.
    if lead:
        check_paths(run_dir, ckpt_dir)
    lock = RunLock(run_dir) if lead else None
    remote = pull_remote(url, run_dir, lock, signals) if url else None
    try:
        check_resume(cfg, ckpt_dir)
    except BaseException:
        let_go(remote, lock)
        raise
    made = [p for p in (ckpt_dir, run_dir, run_dir / precompute.STORE) if not p.exists()]
    moved: list[tuple[Path, Path]] = []  # checkpoint.start_fresh: (old place, aside)
    committed = False

    def undo() -> None:  # a start-up that fails leaves what it made as it found it: absent
        if not lock:
            return
        if not committed:
            for p in made:
                shutil.rmtree(p, ignore_errors=True)
            move_back(moved)
        let_go(remote, lock)

    def commit() -> None:  # training goes on: from here the run directory is this command's
        nonlocal committed
        committed = True
        if lead:
            with signals.writing:
                config.dump(recorded(cfg, asked), run_dir / "config.yaml")
        for old, aside in moved:
            _log(f"checkpoint.start_fresh: the old run is in {aside}")

    signals.on_startup_exit(undo)
    if lock and not url:  # a staged run took its locks before pulling
        with signals.writing:
            lock.acquire()
    try:
        with _run_errors(run_dir):
            if cfg.checkpoint.start_fresh:
                if lead:
                    with signals.writing:
                        moved = move_aside(run_dir, ckpt_dir, cfg.checkpoint.local_dir)
                checkpoint.sync("jaxllm_start_fresh")
            with signals.writing:
                ckpt = checkpoint.Checkpointer(ckpt_dir, cfg.checkpoint, remote, log=_log)
            base = adapters.base_record(cfg)
            state, start = start_state(cfg, ckpt, mesh, tx, shardings, batches, base)
            best = watch.Best.of(cfg, ckpt.directory, start)
            if why := watch.nothing_to_do(cfg, best, start):  # no config.yaml, no pruning
                _log(f"nothing to do: {why}")
                ckpt.close(prune=False)
                undo()
                return {"step": start}
            state, held = companions.attach(state, cfg, mesh, ckpt.directory, start)
            if reference is not None:  # the rows then carry the reference's log-probabilities
                rows = (train_rows, eval_rows)
                batches, held_out = reference.attach(state, start, rows, batches, mesh)
    except BaseException:
        undo()
        raise
    opened: list[MetricsWriter] = []  # the metrics writer once _loop opened it
    try:
        with _run_errors(run_dir):
            return _loop(
                cfg,
                signals,
                state,
                start,
                ckpt,
                jit_train,
                jit_eval,
                batches,
                held_out,
                batch_sh,
                base,
                held,
                commit,
                best,
                asked,
                opened,
            )
    except BaseException as e:
        undo()  # a failed compile: config.yaml not written, a fresh start's old run put back
        for writer in opened:  # the trackers' runs end as failed, not left running
            writer.fail(e)
        raise
    finally:
        let_go(remote, lock)


@contextlib.contextmanager
def _run_errors(run_dir: Path):
    """An OSError of the run's files (read-only, full disk, removed) becomes one RunError line."""
    try:
        yield
    except OSError as e:
        what = e.strerror or type(e).__name__
        raise config.RunError(
            f"{what}: {e.filename or run_dir}; the newest finished checkpoint was left as it was."
        ) from e


def _loop(
    cfg,
    signals,
    state,
    start,
    ckpt,
    jit_train,
    jit_eval,
    batches,
    held_out,
    batch_sh,
    base=None,
    held=None,
    commit=lambda: None,
    best: watch.Best | None = None,
    asked: config.Config | None = None,
    opened: list | None = None,
) -> dict:
    """Trains from `start` to `train.steps`. `commit` runs once the step is compiled, before
    the first step: from there on the run directory is this command's (config.yaml). `best`
    follows the eval metric of `train.early_stopping` / `checkpoint.keep_best`; `asked`: the
    config as given, whose URLs config.yaml and the checkpoints record (`recorded`); `opened`
    receives the metrics writer, which the caller fails if the loop raises."""
    run_dir = Path(cfg.run.dir)
    lead = jax.process_index() == 0
    gbs, steps = cfg.train.global_batch_size, cfg.train.steps
    _log(parameter_line(cfg, state.params))
    extras = {
        "config": config.to_dict(recorded(cfg, asked)),
        "tokenizer": checkpoint.tokenizer_record(cfg.data.tokenizer),
    }
    if base is not None:
        extras[adapters.BASE_ITEM] = base
    if held is not None:
        extras["others"] = held

    def save(at_state, data_state, local: bool = False) -> None:
        kw = {"local": local, **extras}
        row = final if final.get("step") == int(jax.device_get(at_state.step)) else None
        record = best.record() if best is not None else None
        # train.rollout_ahead's next rollout (made in the background): asked for only here
        data_state = {k: v(at_state) if callable(v) else v for k, v in data_state.items()}
        step = ckpt.save(at_state, data_state=data_state, metrics=row, best=record, **kw)
        _log(f"checkpoint: {(ckpt.local if local else ckpt.directory).resolve()}/{step}")

    t0 = time.perf_counter()
    batch = to_global(next_rows(batches, state), batch_sh, gbs)
    data_state = batches.get_state()  # the iterator just after this step's batch
    jit_train = jit_train.lower(state, batch).compile()
    _log(f"compiled train step in {time.perf_counter() - t0:.1f}s")

    commit()
    with signals.writing:
        writer = None
        if lead:
            row = (
                checkpoint.read_json_item(ckpt.directory, start, checkpoint.METRICS_ITEM)
                if start
                else None
            )
            writer = MetricsWriter(
                run_dir,
                resume_step=start,
                resume_row=row,
                tensorboard="tensorboard" in cfg.run.trackers,
                sinks=trackers.open_trackers(cfg.run, extras["config"]),
            )
            if opened is not None:
                opened.append(writer)
            if start and cfg.checkpoint.reset_optimizer:
                writer.write(
                    start, {"optimizer_reset": optimizer_change(cfg, ckpt.directory, start)}
                )
    speed = watch.Speed(cfg)
    patience = cfg.train.early_stopping.patience
    bar = _progress(steps, start) if lead else _Plain()
    final: dict = {}
    pending = None  # (step, metrics on device) of the step dispatched last
    window_start, window_steps = time.perf_counter(), 0
    bad_in_a_row = 0
    scaling = loss_scale.from_config(cfg.optim, cfg.model)
    dynamic = scaling is not None and scaling.dynamic

    def finish(step: int, metrics, at_state=None, last: bool = False) -> bool:
        """Reads step `step`'s metrics (blocking on it), logs them (also when `last`, a stopped
        run's step), evaluates when given the state after that step; False when non-finite
        steps must stop the run."""
        nonlocal window_start, window_steps, final, bad_in_a_row
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        window_steps += 1
        bar.update(1)
        # Under dynamic loss scaling an overflow is how the scale finds its level, not a fault:
        # only a non-finite step at the scale's floor (1, no scaling) counts toward
        # train.nonfinite.
        overflow = values["nonfinite"] and dynamic and values["loss_scale"] > 1
        if overflow:
            _log(
                f"step {step}: gradients overflowed at loss scale {values['loss_scale']:g}; "
                f"update skipped, scale backed off to "
                f"{max(values['loss_scale'] * scaling.backoff, 1.0):g}"
            )
        elif values["nonfinite"]:
            bad_in_a_row += 1
            _log(
                f"step {step}: non-finite loss or gradients (loss {values['loss']}); update skipped"
            )
        else:
            bad_in_a_row = 0
        if step % cfg.train.log_every and at_state is None and not (last or values["nonfinite"]):
            return True
        elapsed = time.perf_counter() - window_start
        values.update(speed.metrics(elapsed, window_steps))
        if at_state is not None and isinstance(batches, Rollouts):
            values.update(batches.evaluate(at_state))  # held-out reward, greedy
        elif at_state is not None and held_out:  # none: no held-out split
            weights = (at_state.params, at_state.model_state, at_state.frozen, at_state.others)
            values.update(evaluate(jit_eval, weights[0], held_out, batch_sh, *weights[1:]))
        if at_state is not None and best is not None:
            best.update(step, values)
        window_start, window_steps = time.perf_counter(), 0  # eval time is not step time
        if writer:
            writer.write(step, values)
        final = {"step": step, **values}
        _show(bar, step, values)
        return not (cfg.train.nonfinite == "stop" and bad_in_a_row >= cfg.train.nonfinite_patience)

    def saves(step: int) -> str | None:  # "dir", "local_dir" (the fast tier) or None
        c = cfg.checkpoint
        periodic = c.every and step % c.every == 0 or c.keep_best and eval_due(step)
        local = c.local_every and step % c.local_every == 0
        return None if step >= steps else "dir" if periodic else "local_dir" if local else None

    def eval_due(step: int) -> bool:
        every = cfg.train.eval_every
        return step == steps or bool(every and step % every == 0)

    stopped = None
    signals.running()  # from here a signal stops the loop with a checkpoint
    for step in range(start + 1, steps + 1):
        state, metrics = jit_train(state, batch)  # dispatch step n ...
        signalled = signals.received is not None  # then stop after step n, its row logged
        step_data_state = data_state
        if step < steps:
            batch = to_global(next_rows(batches, state), batch_sh, gbs)
            data_state = batches.get_state()
        ok = True
        if pending is not None:
            ok = finish(*pending)  # ... then read step n-1 while n runs
            pending = None
        if eval_due(step) or saves(step):  # a checkpoint saves its step's metrics row too
            ok = finish(step, metrics, state if eval_due(step) else None, signalled) and ok
        else:
            pending = (step, metrics)
        if not ok:
            stopped = "nonfinite"
        elif signalled:
            stopped = "signal"
        elif best is not None and eval_due(step) and step < steps and best.exhausted(patience):
            stopped = "early"
        if stopped:
            if pending is not None:  # the step the checkpoint holds, logged whatever log_every
                finish(*pending, last=True)
            _log(
                f"stopping at step {step}: "
                + (
                    "signal received"
                    if stopped == "signal"
                    else best.why(patience)
                    if stopped == "early"
                    else f"{bad_in_a_row} non-finite step(s) in a row (train.nonfinite=stop); the "
                    "checkpoint holds the last finite parameters"
                )
            )
            save(state, step_data_state)
            break
        if tier := saves(step):
            save(state, step_data_state, local=tier == "local_dir")
    bar.close()
    if writer:
        writer.close()
    if stopped is None and (cfg.checkpoint.save_final or cfg.checkpoint.keep_best):
        save(state, step_data_state)
    ckpt.close()  # the checkpoint is complete before anything optional runs
    if writer:
        try:
            plot_losses(writer.path, run_dir / "loss.png")
        except Exception as e:
            warnings.warn(
                f"could not draw {run_dir / 'loss.png'} ({e}); the run is saved.",
                JaxllmWarning,
                stacklevel=2,
            )
    if stopped:
        if writer:
            writer.finish({**final, "stopped": stopped}, [run_dir / "loss.png"])
        if ckpt.mirror is not None:
            ckpt.mirror.finish()  # loss.png, summary.json, ...: the run's every file
        return {**final, "stopped": stopped}

    generates = cfg.model.head == "lm" and cfg.model.kind != "encoder"
    if cfg.train.sample_prompt and cfg.train.sample_tokens and generates:
        weights = (on_device(state.params), state.frozen, state.model_state)
        if jax.process_count() > 1:  # every process takes part in the gather
            from jax.experimental import multihost_utils

            weights = multihost_utils.process_allgather(weights, tiled=True)
        if lead:
            final["sample"] = sample(cfg, *weights)
    if writer:
        writer.finish(final, [run_dir / "loss.png"])
    if ckpt.mirror is not None:
        ckpt.mirror.finish()
    return final
