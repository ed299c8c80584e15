"""TrainState and its sharded initialisation.

Initialisation never builds the model on one device: `jax.eval_shape` gives the abstract
parameters and their logical axes, `jaxllm.sharding` turns those into shardings, and one
`jax.jit(init, out_shardings=...)` creates every leaf directly in its shards.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm import compress, sharding
from jaxllm.config import ConfigError, ModelConfig, PeftConfig, QuantizeConfig
from jaxllm.config.prune import STRUCTURED
from jaxllm.load import frozen_shardings
from jaxllm.model import (
    abstract_frozen,
    abstract_model,
    abstract_model_state,
    build,
    fresh_where_missing,
    init_keys,
    lora,
    peft_parts,
    split_peft,
)
from jaxllm.parallel.grad_compression import Compression


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any  # nested dict of arrays, paths like layers/attn/q_proj
    opt_state: Any  # optax state over params
    rng: jax.Array  # uint32 key data, for dropout and other randomness in the step
    # Model variables that are not trained by gradients (MoE router balancing biases), moved
    # by the step itself; a nested dict like params, {} for most models.
    model_state: Any
    # The dynamic loss scale (`jaxllm.train.loss_scale.LossScaleState`), moved by the step;
    # None when the loss is not scaled or the scale is static.
    loss_scale: Any = None
    # Parameters that do not train (`peft`: the base under the adapters or soft prompt, its
    # matmul weights in NF4 under QLoRA); a nested dict like params, None without peft. Never
    # checkpointed: it is loaded again from the base the run records.
    frozen: Any = None
    # Frozen models the objective reads beside this one (`jaxllm.train.companions`: a DPO
    # reference, a distillation teacher), {name: {"params", "model_state"}}; None without.
    # Never checkpointed: loaded again from the sources the run records.
    others: Any = None
    # Each data replica's state of the compressed gradient exchange (`train.grad_compression`,
    # `jaxllm.parallel.grad_compression`): topk's residuals, leading dim the replicas, split
    # over `data`; None without one.
    grad_comp: Any = None


def _init(
    model_cfg: ModelConfig,
    tx: optax.GradientTransformation,
    seed: int,
    loss_scale=None,
    peft: PeftConfig | None = None,
    quantize: QuantizeConfig | None = None,
    grad_comp=lambda params: None,
) -> TrainState:
    init_key, state_key = init_keys(seed)
    _, params, frozen, model_state = split_peft(build(model_cfg, init_key, peft), peft)
    if peft is not None and peft.dora:  # from the base as stored (NF4 under QLoRA)
        params = lora.fit_magnitudes(params, frozen)
    if frozen is not None and quantize is not None and quantize.enabled:
        # LoRA on a quantized run: the base always comes from checkpoint.init_from, so here
        # only its packed shapes matter (the abstract state of a resume); zeros stand in.
        axes = abstract_frozen(model_cfg, peft)[1]
        packed = compress.quantized_abstract(frozen, axes, quantize)[0]
        frozen = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), packed)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.key_data(state_key),
        model_state=model_state,
        loss_scale=loss_scale,
        frozen=frozen,
        grad_comp=grad_comp(params),
    )


def _dict_keys(path) -> tuple[str, ...]:
    """The trailing dict keys of a key path (a list index after them skipped)."""
    keys = []
    for k in reversed(path):
        if isinstance(k, jax.tree_util.DictKey):
            keys.append(str(k.key))
        elif keys:
            break
    return tuple(reversed(keys))


def _axes_size(mesh: Mesh, axis) -> int:
    """Devices along one spec entry (None, a mesh axis, or a tuple of them)."""
    return int(np.prod([mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis or ())]))


def _add_axes(mesh: Mesh, spec: tuple, shape: tuple, axes) -> tuple:
    """`spec` with mesh `axes` added to the largest dim of `shape` that can take them."""
    as_tuple = lambda a: (a,) if isinstance(a, str) else tuple(a or ())  # noqa: E731
    fits = [
        j
        for j in range(len(shape))
        if shape[j] % (_axes_size(mesh, spec[j]) * _axes_size(mesh, axes)) == 0
    ]
    if not fits:
        return spec
    j = max(fits, key=lambda j: shape[j])
    return spec[:j] + (as_tuple(spec[j]) + as_tuple(axes),) + spec[j + 1 :]


def _moment_sharding(leaf, param, param_sh: NamedSharding, other) -> NamedSharding:
    """The sharding of an optimizer-state leaf kept for `param`: the parameter's own where the
    shapes match; for a reduced shape (Adam-mini's per-block moments, 8-bit scales, Adafactor's
    row/column factors) the parameter's mesh axes on the dims it keeps (a dim shrunk to a count
    of blocks keeps its axis when the count divides evenly)."""
    if leaf.shape == param.shape:
        return param_sh
    spec = tuple(param_sh.spec) + (None,) * (len(param.shape) - len(param_sh.spec))
    if len(leaf.shape) == len(param.shape) - 1:  # a factor: one dim averaged away
        for i in reversed(range(len(param.shape))):
            if param.shape[:i] + param.shape[i + 1 :] == leaf.shape:
                freed, spec = spec[i], spec[:i] + spec[i + 1 :]
                param = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
                # the averaged dim's mesh axes join the largest kept dim they still divide, so
                # the factor stays split as many ways as its parameter
                if freed is not None:
                    spec = _add_axes(param_sh.mesh, spec, leaf.shape, freed)
                break
    if len(leaf.shape) != len(param.shape):
        return other(leaf)

    def keep(axis, n, full):
        if axis is None or n == 1:
            return None
        return axis if n == full or n % _axes_size(param_sh.mesh, axis) == 0 else None

    kept = tuple(keep(a, n, f) for a, n, f in zip(spec, leaf.shape, param.shape))
    for a, k in zip(spec, kept):
        if a is not None and k is None:  # a reduced dim's axes move to a dim that can take them
            kept = _add_axes(param_sh.mesh, kept, leaf.shape, a)
    return NamedSharding(param_sh.mesh, PartitionSpec(*kept))


def sparse_weights(cfg, axes):
    """The tree of bools over the parameters (logical `axes`) whose zeros stay zero while
    training (`optim.keep_zeros`): a pruned run's weights (`prune.*`) under full training; None
    when there are none."""
    if not cfg.prune.enabled or cfg.prune.method in STRUCTURED or cfg.peft.method != "none":
        return None
    return jax.tree_util.tree_map_with_path(
        lambda path, ax: compress.dims(compress.path_of(path), tuple(ax), cfg.prune) is not None,
        axes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def opt_state_shardings(tx: optax.GradientTransformation, abstract_params, param_sh):
    """NamedShardings of `tx`'s state over parameters laid out as `param_sh`: each leaf kept
    for a parameter shards like it (`_moment_sharding`); counters and small vectors are
    replicated; a large leaf that follows no parameter is an error."""
    mesh = jax.tree.leaves(param_sh)[0].mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    largest_dim = max(max(p.shape, default=1) for p in jax.tree.leaves(abstract_params))

    def other_leaf(leaf):
        # counts, scalars and per-dim vectors (SM3's row/column accumulators) are replicated;
        # anything larger without a rule would silently cost a full copy on every device
        if leaf.size <= largest_dim:
            return replicated
        raise ConfigError(
            f"the optimizer keeps a state of shape {leaf.shape} that follows no parameter, so "
            "it has no sharding rule; pick another optim.name."
        )

    # A state leaf belongs to the parameter whose dict path ends its own key path (optax keeps
    # per-parameter state in trees shaped like the parameters; SM3 adds a list index).
    # `optax.tree_map_params` cannot be used: it initialises the optimizer on a placeholder,
    # which Muon's parameter labelling rejects.
    by_path = {
        _dict_keys(path): (p, s)
        for (path, p), s in zip(
            jax.tree_util.tree_flatten_with_path(abstract_params)[0], jax.tree.leaves(param_sh)
        )
    }

    def leaf_sharding(path, leaf):
        keys = _dict_keys(path)
        for start in range(len(keys)):
            if keys[start:] in by_path:
                p, s = by_path[keys[start:]]
                return _moment_sharding(leaf, p, s, other_leaf)
        return other_leaf(leaf)

    return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_opt)


def on_device(tree):
    """`tree` with every leaf kept in host memory (`model.param_offload=host`,
    `optim.offload=host`) copied to device memory, in the same shards; others as they are."""

    def one(x):
        sh = getattr(x, "sharding", None)
        if getattr(sh, "memory_kind", None) not in ("pinned_host", "unpinned_host"):
            return x
        return jax.device_put(x, sh.with_memory_kind("device"))

    return jax.tree.map(one, tree)


def layout(cfg) -> dict:
    """The `state_shardings` / `init_state` keywords a `Config` asks for: ZeRO stage,
    optimizer-state offload, what trains (`peft`) and how its frozen base is packed (the
    `quantize` section of LoRA on a quantized run)."""
    return {
        "zero_stage": cfg.mesh.zero_stage,
        "offload": cfg.optim.offload == "host",
        "peft": cfg.peft,
        "quantize": cfg.quantize,
        "grad_compression": Compression.of(cfg),
    }


# The mesh axes ZeRO stages 1 and 2 split optimizer state and gradients over: the replicas.
ZERO_AXES = ("data",)


def zero_shardings(abstract_params, param_sh):
    """Each parameter's sharding with the `ZERO_AXES` added to its largest dim they divide
    (after the parameter's own axes): where ZeRO keeps that parameter's optimizer state (stage
    1) and gradient (stage 2). A parameter none of whose dims they divide keeps its sharding."""

    def one(leaf, s: NamedSharding) -> NamedSharding:
        axes = tuple(a for a in ZERO_AXES if s.mesh.shape[a] > 1)
        if not axes:
            return s
        spec = tuple(s.spec) + (None,) * (len(leaf.shape) - len(s.spec))
        return NamedSharding(s.mesh, PartitionSpec(*_add_axes(s.mesh, spec, leaf.shape, axes)))

    return jax.tree.map(one, abstract_params, param_sh)


def grad_shardings(model_cfg: ModelConfig, mesh: Mesh, zero_stage: int = 0, peft=None):
    """Where the step keeps gradients (of what trains under `peft`): like their parameters, or
    split over the replicas (`zero_shardings`) from ZeRO stage 2 on."""
    _, abstract_params, axes = abstract_model(model_cfg, peft)
    param_sh = sharding.tree_shardings(mesh, axes)
    return zero_shardings(abstract_params, param_sh) if zero_stage >= 2 else param_sh


def state_shardings(
    model_cfg: ModelConfig,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    loss_scaling=None,
    *,
    zero_stage: int = 0,
    offload: bool = False,
    peft: PeftConfig | None = None,
    quantize: QuantizeConfig | None = None,
    grad_compression: Compression | None = None,
):
    """NamedShardings of every TrainState leaf: params, their optimizer moments, the frozen
    base of `peft` and the model state by the logical rules, scalars (the loss scale of
    `loss_scaling` among them) replicated. From `zero_stage` 1 on the optimizer state is also
    split over the replicas; with `offload` it lives in host memory (`pinned_host`), and so do
    the parameters with `model_cfg.param_offload=host`."""
    _, abstract_params, axes = abstract_model(model_cfg, peft)
    sharding.check_divisible(mesh, abstract_params, axes)
    param_sh = sharding.tree_shardings(mesh, axes)
    replicated = NamedSharding(mesh, PartitionSpec())
    moment_sh = zero_shardings(abstract_params, param_sh) if zero_stage else param_sh
    opt_sh = opt_state_shardings(tx, abstract_params, moment_sh)
    if offload:
        opt_sh = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), opt_sh)
    if model_cfg.param_offload == "host":  # ZeRO-Offload of the parameters
        param_sh = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), param_sh)
    _, model_state_axes = abstract_model_state(model_cfg)
    model_state_sh = sharding.tree_shardings(mesh, model_state_axes)
    return TrainState(
        step=replicated,
        params=param_sh,
        opt_state=opt_sh,
        rng=replicated,
        model_state=model_state_sh,
        loss_scale=_initial_loss_scale(loss_scaling, lambda _: replicated),
        frozen=frozen_shardings(model_cfg, mesh, peft, quantize),
        grad_comp=jax.tree.map(
            lambda _: NamedSharding(mesh, PartitionSpec("data")),
            jax.eval_shape(_grad_comp_init(grad_compression, mesh), abstract_params),
        ),
    )


def _grad_comp_init(compression: Compression | None, mesh: Mesh):
    """params -> the compressed exchange's state for the mesh's data replicas (None without)."""
    if compression is None:
        return lambda params: None
    return lambda params: compression.init(params, mesh.shape["data"])


def _initial_loss_scale(loss_scaling, leaf=lambda x: x):
    """The dynamic loss scale's start (None without one), each leaf passed through `leaf`."""
    if loss_scaling is None:
        return None
    return jax.tree.map(leaf, loss_scaling.initial())


def init_state(
    model_cfg: ModelConfig,
    tx,
    mesh: Mesh,
    seed: int,
    loss_scaling=None,
    *,
    zero_stage: int = 0,
    offload: bool = False,
    peft: PeftConfig | None = None,
    quantize: QuantizeConfig | None = None,
    grad_compression: Compression | None = None,
) -> TrainState:
    """A freshly initialised TrainState, each leaf created in its shards (`state_shardings`);
    `loss_scaling` (`jaxllm.train.loss_scale.LossScaling`, None: no scaling) gives the loss
    scale's start; under `peft` the base is the seed's random one."""
    shardings = state_shardings(
        model_cfg,
        tx,
        mesh,
        loss_scaling,
        zero_stage=zero_stage,
        offload=offload,
        peft=peft,
        quantize=quantize,
        grad_compression=grad_compression,
    )
    comp = _grad_comp_init(grad_compression, mesh)
    init = jax.jit(
        lambda: _init(model_cfg, tx, seed, _initial_loss_scale(loss_scaling), peft, quantize, comp),
        out_shardings=shardings,
    )
    return init()


def init_state_from(
    params,
    model_cfg: ModelConfig,
    tx,
    mesh: Mesh,
    seed: int,
    model_state=None,
    loss_scaling=None,
    *,
    zero_stage: int = 0,
    offload: bool = False,
    peft: PeftConfig | None = None,
    quantize: QuantizeConfig | None = None,
    adapters=None,
    grad_compression: Compression | None = None,
) -> TrainState:
    """A TrainState at step 0 around given (already sharded) parameters and model state (MoE
    routing biases; None: zeros): fresh optimizer state, rng and loss scale, each leaf in its
    shards (fine-tuning, `checkpoint.init_from`). Under `peft` the parameters are the frozen
    base, and the adapters / soft prompt are `adapters` (imported ones) or start fresh from
    the seed. Without it, the top-level parameters `params` lacks start fresh from the seed
    too: the score head of a reward model started from a language model, the vision tower of a
    vision-language model started from a text run (`load_weights`), under `peft` in its base."""
    shardings = state_shardings(
        model_cfg,
        tx,
        mesh,
        loss_scaling,
        zero_stage=zero_stage,
        offload=offload,
        peft=peft,
        quantize=quantize,
        grad_compression=grad_compression,
    )

    abstract_ms, _ = abstract_model_state(model_cfg)

    def init(params, model_state, adapters):
        init_key, state_key = init_keys(seed)  # as `_init`: the same streams
        if model_state is None:
            model_state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_ms)
        params = fresh_where_missing(params, model_cfg, seed)  # a new head or vision tower
        frozen = None
        if peft is not None and peft.method != "none":  # the adapters of a fresh init
            frozen_axes = abstract_frozen(model_cfg, peft)[1]  # a source's value head: not base
            frozen = lora.freeze({k: params[k] for k in frozen_axes}, frozen_axes, peft)
            fresh = _init(model_cfg, tx, seed, None, peft).params
            params = peft_parts.saved_from(fresh, params, peft)  # modules_to_save: the base's
            if peft.dora:  # DoRA's magnitudes start at the loaded base's norms
                params = lora.fit_magnitudes(params, frozen)
            if adapters is not None:  # a value head beside imported adapters starts fresh
                params = {**params, **adapters}
            elif peft.method == "prompt":  # from the loaded base's embeddings
                n, vocab = peft.num_virtual_tokens, model_cfg.vocab_size
                ids = lora.prompt_token_ids(lora.peft_key(init_key), n, vocab)
                embedding = frozen["embed"]["embedding"]
                params = {**params, "soft_prompt": embedding[ids].astype(embedding.dtype)}
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            frozen=frozen,
            opt_state=tx.init(params),
            rng=jax.random.key_data(state_key),
            model_state=model_state,
            loss_scale=_initial_loss_scale(loss_scaling),
            grad_comp=_grad_comp_init(grad_compression, mesh)(params),
        )

    return jax.jit(init, out_shardings=shardings)(params, model_state, adapters)
