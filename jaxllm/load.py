"""Loading trained weights: from a run directory (or its checkpoints, or one step) and from a
Hugging Face model directory, always straight into their shards on a mesh.

    resolve(path)                  -> (run dir, checkpoints dir, step or None)
    model_section(source, key)     -> the ModelConfig of a run or Hugging Face directory
    pick_step(ckpt_dir, step, which) -> the step `--checkpoint best|last|STEP` names
    restore(path, overrides)       -> Restored(cfg, mesh, graphdef, params, model_state, step)
    load_model(path)               -> an nnx.Module (a run's, adapters and all; or a HF dir's)
    load_weights(source, cfg, mesh) -> (params, model state): `checkpoint.init_from`
    fetched_inputs(cfg)            -> cfg with its model URLs replaced by their local copies

A `gs://` / `s3://` URL of a run or Hugging Face directory is read from its local copy
(`jaxllm.storage.fetch`), so everything below sees local paths.

Every reader takes the newest readable checkpoint unless a step is named (its directory,
`--checkpoint STEP`, or `--checkpoint best`: the newest checkpoint's best by evaluation,
`checkpoint.keep_best`); a damaged newer one is skipped with a JaxllmWarning."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxllm import checkpoint, compress, config, sharding, storage
from jaxllm.config import Config, ConfigError, ModelConfig, PeftConfig, RunError
from jaxllm.convert import is_hf_dir, load_params, model_config
from jaxllm.data import check_vocab
from jaxllm.data.tokenizer import fetched_tokenizer
from jaxllm.model import (
    abstract_frozen,
    abstract_model,
    abstract_model_state,
    build,
    fresh_where_missing,
    init_keys,
    lora,
    merge_model,
    split_peft,
)

__all__ = ["BASE_ITEM", "MODEL_KEYS", "Restored", "base_record", "check_base", "check_shapes",
           "content_hash", "fetched", "fetched_inputs", "frozen_shardings", "load_frozen",
           "load_model", "load_weights", "merged_weights", "model_section", "pick_step", "resolve",
           "restore", "weight_files", "weight_targets"]  # fmt: skip


class Restored(NamedTuple):
    """A run's weights restored onto its configured mesh (`restore`)."""

    cfg: config.Config
    mesh: Mesh
    graphdef: Any  # nnx.GraphDef: `nnx.merge(graphdef, params, model_state)` is the model
    params: dict
    model_state: dict  # non-trained model variables (MoE routing biases); {} for most models
    step: int
    frozen: dict | None = None  # a PEFT run's base (params are then its adapters / prompt)

    def model(self) -> nnx.Module:
        """The restored model (with its adapters unmerged, for a PEFT run)."""
        return merge_model(self.graphdef, self.params, self.frozen, self.model_state)


def fetched(path, key: str):
    """`path` unchanged, or for a `gs://` / `s3://` URL the path of its local copy (a str)."""
    return str(storage.fetch(path, key)) if storage.is_url(path) else path


# the keys that name a model to read: (section, field)
MODEL_KEYS = (("checkpoint", "init_from"), ("train", "teacher"), ("train", "reference"))


def fetched_inputs(cfg: Config) -> Config:
    """`cfg` with every model it reads from a bucket (`checkpoint.init_from`, `train.teacher`,
    `train.reference`, a reward model's `train.reward`) and its `data.tokenizer` replaced by
    their local copies, fetched now; the same `cfg` when none is a URL."""
    changes = {}
    for section, field in (*MODEL_KEYS, ("train", "reward")):
        value = getattr(getattr(cfg, section), field)
        if storage.is_url(value):
            changes.setdefault(section, {})[field] = fetched(value, f"{section}.{field}")
    if storage.is_url(cfg.data.tokenizer):  # with the files read beside it
        changes["data"] = {"tokenizer": fetched_tokenizer(cfg.data.tokenizer)}
    for section, fields in changes.items():
        cfg = dataclasses.replace(
            cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)}
        )
    return cfg


def resolve(path: str | Path) -> tuple[Path, Path | None, int | None]:
    """A run directory, its checkpoints directory, or one step's directory ->
    (run dir, checkpoints dir or None for the configured one, step or None for the newest)."""
    path = Path(path)
    for run_dir, ckpt_dir, step in (
        (path, None, None),
        (path.parent, path, None),
        (path.parent.parent, path.parent, path.name),
    ):
        if (run_dir / "config.yaml").is_file():
            if step is not None and not step.isdigit():
                continue
            return run_dir, ckpt_dir, None if step is None else int(step)
    raise ConfigError(
        f"{path} is not a run directory, its checkpoints directory, or a checkpoint step in one."
    )


def model_section(source: str | Path, key: str) -> ModelConfig:
    """The model section of a run directory (its config.yaml, adapters merged away) or a
    Hugging Face directory; ConfigError naming `key` when `source` is neither."""
    path = Path(source)
    if is_hf_dir(path):
        return model_config(path).model
    if not path.exists():
        raise ConfigError(f"{key}={source} does not exist.")
    return config.load(resolve(path)[0] / "config.yaml").model  # resolve: ConfigError if no run


def pick_step(ckpt_dir: Path, step: int | None, which: str = "last") -> int | None:
    """The step `--checkpoint which` names (`last`: `step`, None for the newest readable;
    `best`: the best step the run recorded; digits: that step); ConfigError when that
    checkpoint does not exist or `which` and a step's directory both name one."""
    which = str(which)
    if which == "last":
        return step
    if step is not None:
        raise ConfigError(
            f"--checkpoint {which} and the step directory {ckpt_dir / str(step)} both name a "
            "checkpoint; give the run directory with --checkpoint, or the step's directory alone."
        )
    if which == "best":
        best = checkpoint.best_step(ckpt_dir)
        if best is None:
            raise ConfigError(
                f"--checkpoint best: no checkpoint in {ckpt_dir} records a best step (train "
                "with checkpoint.keep_best=true)."
            )
        if best not in checkpoint.steps(ckpt_dir):
            raise ConfigError(
                f"--checkpoint best: the best step, {best}, is no longer in {ckpt_dir} (train "
                "with checkpoint.keep_best=true to keep it)."
            )
        return best
    if not which.isdigit():
        raise ConfigError(f"--checkpoint must be best, last or a step number, not {which!r}.")
    found = checkpoint.steps(ckpt_dir)
    if int(which) not in found:
        have = ", ".join(map(str, found)) or "none"
        raise ConfigError(
            f"--checkpoint {which}: no checkpoint of that step in {ckpt_dir} (it has {have})."
        )
    return int(which)


def weight_targets(model_cfg: ModelConfig, mesh: Mesh, peft=None, quantize=None):
    """(graphdef, params target, model-state target): the abstract weights of `model_cfg` (the
    adapters / prompt of `peft`, the packed codes `quantize` describes) as ShapeDtypeStructs
    carrying their shardings on `mesh`, ready for `checkpoint.restore_weights`."""
    graphdef, abstract, axes = abstract_model(model_cfg, peft)
    abstract, axes = compress.quantized_abstract(abstract, axes, quantize)
    sharding.check_divisible(mesh, abstract, axes)
    abstract_ms, ms_axes = abstract_model_state(model_cfg)
    return graphdef, _on(mesh, abstract, axes), _on(mesh, abstract_ms, ms_axes)


def _on(mesh: Mesh, abstract, axes):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract,
        sharding.tree_shardings(mesh, axes),
    )


def restore(
    path, overrides=(), *, mesh: Mesh | None = None, base: bool = True, which: str = "last"
) -> Restored:
    """A run directory / checkpoint path -> its config (with `overrides`) and the weights of the
    newest readable (or the named) checkpoint, restored straight into their shards. Without
    `mesh`, on the configured mesh over all devices, and the run's tokenizer must fit the model
    (`eval` and `generate` use both); with `mesh`, the weights alone on that mesh. A PEFT run's
    base is loaded (and checked) too, unless `base` is False (`frozen` is then None). `which`:
    `--checkpoint best|last|STEP` (`pick_step`). ConfigError when there is nothing to restore."""
    run_dir, ckpt_dir, step = resolve(path)
    cfg = config.load(run_dir / "config.yaml", list(overrides))
    ckpt_dir = ckpt_dir or checkpoint.checkpoint_dir(run_dir, cfg.checkpoint.dir)
    step = pick_step(ckpt_dir, step, which)
    if mesh is None:
        check_vocab(cfg.data, cfg.model.vocab_size)
        devices = jax.devices()
        cfg.validate(len(devices))
        mesh = sharding.make_mesh(cfg.mesh, devices)
    graphdef, target, ms_target = weight_targets(cfg.model, mesh, cfg.peft, cfg.quantize)
    params, model_state, step = checkpoint.restore_weights(ckpt_dir, target, ms_target, step)
    frozen = None
    if cfg.peft.method != "none" and base:  # the base the adapters were trained on
        record = checkpoint.read_json_item(ckpt_dir, step, BASE_ITEM)
        if record is None:
            raise ConfigError(f"{ckpt_dir}/{step} has no record of its fine-tuning base.")
        frozen = load_frozen(cfg, mesh, record, verify=True)
    return Restored(cfg, mesh, graphdef, params, model_state, step, frozen)


def load_model(path, *, mesh: Mesh | None = None, overrides=()) -> nnx.Module:
    """A trained model from a run directory (or its checkpoints directory, or one step), or a
    Hugging Face model directory (config.json + safetensors; `overrides` like
    `model.dtype=float32` apply). Returns an `nnx.Module` mapping int tokens [batch, length] to
    float32 logits [batch, length, vocab], its parameters restored straight into their shards
    on `mesh` (default: all devices, data-parallel, i.e. replicated). A `gs://` / `s3://` URL
    is read from its local copy."""
    path = Path(fetched(path, "path"))
    if _is_hf_source(path):
        cfg = model_config(path, overrides)
        mesh = mesh or sharding.make_mesh(cfg.mesh)
        graphdef = abstract_model(cfg.model)[0]
        params, model_state, _ = load_params(path, cfg.model, mesh)
        return nnx.merge(graphdef, params, model_state)
    try:
        resolve(path)
    except ConfigError:
        raise FileNotFoundError(
            f"{path} is neither a run directory, its checkpoints directory, nor a Hugging Face "
            "model directory"
        ) from None
    return restore(path, overrides, mesh=mesh or sharding.make_mesh(config.MeshConfig())).model()


def load_weights(source, model_cfg: ModelConfig, mesh: Mesh, *, quantize=None):
    """(parameters, model state) for `model_cfg` from a Hugging Face directory or a jaxllm run
    directory / checkpoint (`checkpoint.init_from`), in their shards on `mesh`. The source
    must describe the same parameter shapes; ConfigError names the first that differs. The
    model state (MoE routing biases) is None when the source has none of this model's shapes.
    Exceptions (`_as_source`; `init_state_from` starts what is absent fresh from the seed): a
    reward model (`model.head=score`) started from an LM reads its body only; PPO's value head
    starts fresh when the source has none, and a source's one this model lacks stays behind; a
    vision-language model started from a text run reads the language model only.

    A fine-tuning run (peft) as the source gives its merged model (`convert export --merge`; a
    prompt-tuning run: ConfigError). A quantized run is read only as LoRA's frozen base, in its
    codes: `quantize` must be its `quantize` section (else ConfigError)."""
    source = fetched(source, "checkpoint.init_from")
    hf = _is_hf_source(source)
    if hf:
        theirs = model_config(source)
    else:
        if not Path(source).exists():
            raise ConfigError(f"checkpoint.init_from={source} does not exist.")
        run_dir, ckpt_dir, step = resolve(source)
        theirs = config.load(run_dir / "config.yaml")
        if theirs.peft.method == "none" and theirs.quantize != (
            quantize or config.QuantizeConfig()
        ):
            compress.not_trained(theirs.quantize, f"checkpoint.init_from={source}")
    target_cfg, model_cfg = model_cfg, check_shapes(source, model_cfg, theirs.model)
    if hf:
        params, model_state, _ = load_params(source, model_cfg, mesh)
        return _heads_of(params, target_cfg), model_state
    ckpt_dir = ckpt_dir or checkpoint.checkpoint_dir(run_dir, theirs.checkpoint.dir)
    _, target, ms_target = weight_targets(model_cfg, mesh, quantize=quantize)
    want_ms = _shapes(abstract_model_state(model_cfg)[0])
    same_ms = bool(want_ms) and want_ms == _shapes(abstract_model_state(theirs.model)[0])
    if theirs.peft.method != "none":  # a fine-tuning run: its merged model
        _mergeable(source, theirs)
        restored = restore(source, mesh=mesh)
        params = merged_weights(restored, target)
        return _heads_of(params, target_cfg), restored.model_state if same_ms else None
    if not same_ms:
        params = checkpoint.restore_weights(ckpt_dir, target, step=step).params
        return _heads_of(params, target_cfg), None
    weights = checkpoint.restore_weights(ckpt_dir, target, ms_target, step)
    return _heads_of(weights.params, target_cfg), weights.model_state


def check_shapes(source, model_cfg: ModelConfig, theirs: ModelConfig) -> ModelConfig:
    """The model to read from `source`, whose model section is `theirs` (`_as_source`);
    ConfigError naming the first parameter whose shape differs from `model_cfg`'s."""
    read = _as_source(model_cfg, theirs)
    want, have = _shapes(abstract_model(read)[1]), _shapes(abstract_model(theirs)[1])
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))[0][0]
        raise ConfigError(
            f"checkpoint.init_from={source} has other parameters than this model (first: "
            f"{diff}: {have.get(diff)} there, {want.get(diff)} here); make the model "
            "section match it (e.g. start from its config.yaml)."
        )
    return read


def merged_weights(restored: Restored, target) -> dict:
    """The plain parameters of a restored fine-tuning run (`restore` with its base): every
    adapter merged into its weight, W + s A B, NF4 dequantized (`lora.merged_params`), in the
    dtypes and shards of `target` (`weight_targets` of the model without peft)."""
    out_sh = jax.tree.map(lambda t: t.sharding, target)

    def merge(params, frozen, model_state):
        merged = lora.merged_params(restored.graphdef, params, frozen, model_state)
        return jax.tree.map(lambda x, t: x.astype(t.dtype), merged, target)

    return jax.jit(merge, out_shardings=out_sh)(
        restored.params, restored.frozen, restored.model_state
    )


def _mergeable(source, theirs: Config) -> None:
    """ConfigError for a run with no merged model: a soft prompt, nonlinear bottleneck adapters."""
    m, base = theirs.peft.method, theirs.checkpoint.init_from
    if m in ("prompt", "adapter"):
        kind = "prompt-tuning" if m == "prompt" else "bottleneck-adapter"
        what = "soft prompt merges" if m == "prompt" else "nonlinear adapters merge"
        raise ConfigError(
            f"checkpoint.init_from={source} is a {kind} run (peft.method={m}), whose {what} "
            f"into no weight; continue it with peft.method={m} and checkpoint.init_adapters="
            "continue, or start from its base" + (f" ({base})." if base else ".")
        )


def _as_source(model_cfg: ModelConfig, theirs: ModelConfig) -> ModelConfig:
    """The model to read from a source of model `theirs`: `model_cfg` with the source's value
    head, score bias and distillation projections or none (one this model lacks is left behind,
    one it has starts fresh), for a reward model from an LM the body with the LM's head, and
    for a vision-language model from a text run the language model alone (its tower fresh)."""
    vision = model_cfg.vision if theirs.vision else None
    heads = dict(value_head=theirs.value_head, distill_proj=theirs.distill_proj, vision=vision)
    heads["score_bias"] = theirs.score_bias and model_cfg.head == "score"
    model_cfg = dataclasses.replace(model_cfg, **heads)
    if model_cfg.head == "score" and theirs.head == "lm":
        return dataclasses.replace(model_cfg, head="lm", tie_embeddings=theirs.tie_embeddings)
    return model_cfg


def _heads_of(params: dict, model_cfg: ModelConfig) -> dict:
    """`params` without the heads `model_cfg` lacks (an LM's under a reward model, a value
    head, a score bias); a source's distillation projections never."""
    has = dict(lm_head=model_cfg.head == "lm", value=model_cfg.value_head, distill_proj=False)
    has["score_bias"] = model_cfg.score_bias
    return {k: v for k, v in params.items() if has.get(k, True)}


def _is_hf_source(source) -> bool:
    """A Hugging Face directory, even a broken one (its config.json and no run config.yaml), so
    that what is wrong with it is named rather than "not a run directory"."""
    path = Path(source)
    return is_hf_dir(path) or (
        (path / "config.json").is_file() and not (path / "config.yaml").is_file()
    )


def _shapes(tree) -> dict[str, tuple]:
    """{'layers/attn/q_proj': shape, ...} of a nested dict of arrays."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(k.key) for k in path): tuple(a.shape) for path, a in flat}


# ---------------------------------------------------------------- a fine-tuning run's base

BASE_ITEM = "base"


def weight_files(source: Path) -> tuple[Path, list[Path]]:
    """(the path to load, the files whose bytes are the base): a Hugging Face directory's
    config.json and safetensors, or the parameters of one jaxllm checkpoint step (the newest
    with parameters when `source` is a run or checkpoints directory)."""
    if is_hf_dir(source):
        return source, sorted(source.glob("*.safetensors")) + [source / "config.json"]
    run_dir, ckpt_dir, step = resolve(source)
    if step is None:
        saved = config.load(run_dir / "config.yaml")
        ckpt_dir = ckpt_dir or checkpoint.checkpoint_dir(run_dir, saved.checkpoint.dir)
        with_params = [
            s for s in checkpoint.steps(ckpt_dir) if (ckpt_dir / str(s) / "params").is_dir()
        ]
        if not with_params:
            raise RunError(f"checkpoint.init_from={source} holds no checkpoint with parameters.")
        source = ckpt_dir / str(with_params[-1])
    return source, sorted(p for p in (source / "params").rglob("*") if p.is_file())


def content_hash(files: list[Path], root: Path) -> str:
    """SHA-256 over the files' paths (relative to `root`) and bytes, in order."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def base_record(cfg: Config) -> dict | None:
    """What this run's base is (None without peft): {"source", "sha256"} for
    `checkpoint.init_from` (a run or checkpoints directory resolved to its newest step), else
    {"seed"}: the random initialisation of `run.seed`."""
    if cfg.peft.method == "none":
        return None
    if not cfg.checkpoint.init_from:
        return {"seed": cfg.run.seed}
    source, files = weight_files(Path(cfg.checkpoint.init_from).resolve())
    return {"source": str(source), "sha256": content_hash(files, source)}


def check_base(recorded: dict | None, current: dict | None) -> None:
    """RunError when a run's checkpoints were trained on another base than `current`."""
    if not recorded or recorded == current:
        return
    if current and recorded.get("sha256") and recorded.get("sha256") == current.get("sha256"):
        return  # the same weights, found at another path
    raise RunError(
        f"this run's adapters were trained on the base {_describe(recorded)}, but "
        f"checkpoint.init_from gives {_describe(current)}; point checkpoint.init_from at the "
        "run's base, or start a new run.dir."
    )


def _describe(record: dict | None) -> str:
    if not record:
        return "none"
    if "seed" in record:
        return f"initialised randomly with run.seed={record['seed']}"
    return f"{record['source']} (sha256 {record['sha256'][:12]})"


def load_frozen(cfg: Config, mesh, record: dict, *, verify: bool = False):
    """The frozen base of a PEFT run from its `record`, in its shards on `mesh`; with `verify`,
    RunError when the recorded path no longer holds the recorded weights."""
    shardings = frozen_shardings(cfg.model, mesh, cfg.peft, cfg.quantize)
    if "seed" in record:
        init_key = init_keys(record["seed"])[0]
        init = lambda: split_peft(build(cfg.model, init_key, cfg.peft), cfg.peft)[2]  # noqa: E731
        return jax.jit(init, out_shardings=shardings)()
    if verify:
        source, files = weight_files(Path(record["source"]))
        check_base(record, {"source": str(source), "sha256": content_hash(files, source)})
    params, _ = load_weights(record["source"], cfg.model, mesh, quantize=cfg.quantize)
    axes = abstract_frozen(cfg.model, cfg.peft)[1]
    fill = lambda p: fresh_where_missing(p, cfg.model, cfg.run.seed)  # noqa: E731 (a new tower)
    return jax.jit(lambda p: lora.freeze(fill(p), axes, cfg.peft), out_shardings=shardings)(params)


def frozen_shardings(model_cfg: ModelConfig, mesh: Mesh, peft: PeftConfig | None, quantize=None):
    """NamedShardings of the frozen base under `peft` (None without), packed as `quantize` says."""
    if peft is None or peft.method == "none":
        return None
    abstract, axes = compress.quantized_abstract(*abstract_frozen(model_cfg, peft), quantize)
    sharding.check_divisible(mesh, abstract, axes)
    return sharding.tree_shardings(mesh, lora.frozen_axes(abstract, axes, peft))
