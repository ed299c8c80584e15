"""The transformer; by default a decoder, Llama-style (Touvron et al. 2023, arXiv:2302.13971):
pre-RMSNorm blocks of GQA attention with RoPE and a SwiGLU MLP, a final RMSNorm and an
(optionally tied) LM head. `ModelConfig` knobs reach GPT-2 (learned positions, LayerNorm, GELU,
biases), Mistral / Qwen (sliding windows, qkv biases, QK-norm) and Gemma 2 (sandwich norms,
GeGLU, soft caps, alternating local/global layers, embeddings scaled by sqrt(D)). With
`ModelConfig.kind=encoder` the same stack attends bidirectionally (BERT / RoBERTa, with token
types, an embedding norm, the MLM head and a pooler from `ModelConfig.encoder`; `heads.py`).

The N blocks are created stacked (every block parameter has a leading `layers` axis) and run
with `jax.lax.scan`, so compile time does not grow with depth and pipeline stages can later be
slices of the stack. Each block is optionally rematerialised (`ModelConfig.remat`).

With mixture-of-experts layers (`ModelConfig.moe`) there are two kinds of blocks: the first k
dense blocks form the stack `layers`, and the rest repeat a pattern of (moe_every - 1) dense
blocks and one MoE block, stacked as `moe_layers` (each element a `MoEGroup`) and scanned the
same way, so any "first k dense, then every n-th MoE" layout is one or two scans. Per-layer scan
inputs (window flags, dropout keys, the cache's layer index) are arrays over all N layers, cut
to match.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ModelConfig, PeftConfig
from jaxllm.config.linear_attention import layer_kinds
from jaxllm.model import bottleneck, fp8_delayed, heads, hybrid, lora
from jaxllm.model import deepstack as deepstack_lib
from jaxllm.model import moe as moe_lib
from jaxllm.model.block import Block, HybridGroup, MoEGroup, apply_dropout, stack
from jaxllm.model.hybrid import dense_layers
from jaxllm.model.layers import Embed, default_positions, logical_axes, make_norm, matmul, param
from jaxllm.model.outputs import ModelOutput
from jaxllm.model.remat import policy
from jaxllm.sharding import constrain


class Transformer(nnx.Module):
    """tokens [B, L] int -> logits [B, L, V] float32 (scores [B, L, 1] with the score head of
    a reward model, `ModelConfig.head`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg.validate()  # a ModelConfig built in Python is checked here
        dtype, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed = Embed(
            cfg.vocab_size,
            cfg.d_model,
            init_std=cfg.init_std,
            dtype=dtype,
            param_dtype=pdt,
            rngs=rngs,
        )
        if cfg.position == "learned":
            init = jax.nn.initializers.normal(cfg.init_std)
            self.pos_embed = param(
                rngs, init, (cfg.max_seq_len, cfg.d_model), ("positions", "embed"), pdt
            )
        enc = cfg.encoder
        if enc.type_vocab_size:  # BERT's token types (segment A / B)
            init = jax.nn.initializers.normal(cfg.init_std)
            self.type_embed = param(
                rngs, init, (enc.type_vocab_size, cfg.d_model), (None, "embed"), pdt
            )
        if enc.embed_norm:
            self.embed_norm = make_norm(cfg)

        moe = cfg.moe
        n_dense = dense_layers(cfg)
        self.layers = stack(n_dense, lambda r: Block(cfg, rngs=r), rngs) if n_dense else None
        if cfg.layer_pattern:  # hybrid: one scan over repeats of the pattern
            groups = cfg.num_layers // len(cfg.layer_pattern)
            self.hybrid_layers = stack(groups, lambda r: HybridGroup(cfg, rngs=r), rngs)
        elif moe.enabled:
            groups = (cfg.num_layers - n_dense) // moe.moe_every
            self.moe_layers = stack(groups, lambda r: MoEGroup(cfg, rngs=r), rngs)
        if cfg.norm_placement != "post":  # post-norm blocks already end on a norm
            self.final_norm = make_norm(cfg)
        init = jax.nn.initializers.normal(cfg.init_std)
        if enc.mlm_head:  # BERT's transform before the vocabulary, a bias after it
            self.mlm_transform = heads.MLMTransform(cfg, rngs=rngs)
            zeros = jax.nn.initializers.zeros
            self.lm_bias = param(rngs, zeros, (cfg.vocab_size,), ("vocab",), pdt)
        if enc.pooler:
            self.pooler = heads.Pooler(cfg, rngs=rngs)
        if cfg.head == "score":  # a reward model's scalar head instead of the LM head
            self.score = param(rngs, init, (cfg.d_model, 1), ("embed", None), pdt)
            if cfg.score_bias:
                self.score_bias = param(rngs, jax.nn.initializers.zeros, (1,), (None,), pdt)
        elif not cfg.tie_embeddings:
            self.lm_head = param(rngs, init, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt)
        if cfg.value_head:  # PPO's critic on the policy's own final hidden state
            value = init(rngs.params(), (cfg.d_model, 1), pdt)
            self.value = lora.ValueParam(value, axes=("embed", None))
        if cfg.distill_proj:  # feature distillation's maps into the teacher's width
            n, d_teacher = cfg.distill_proj
            init = jax.nn.initializers.normal(cfg.d_model**-0.5)
            shape, axes = (n, cfg.d_model, d_teacher), (None, "embed", None)
            self.distill_proj = param(rngs, init, shape, axes, pdt)

    def __call__(
        self,
        tokens_BxL=None,
        *,
        positions_BxL=None,
        segment_ids_BxL=None,
        embeddings_BxLxD=None,
        cache=None,
        logits_at_BxQ=None,
        dropout_key=None,
        token_types_BxL=None,
        prefix_BxL=None,
        hidden_only=False,
        hidden_states=False,
        deepstack=None,
    ) -> ModelOutput:
        """Either tokens or input embeddings (for soft prompts, and gradient tests) go in.

        Returns a `ModelOutput(logits, cache, aux, values)` whatever the flags. Generation passes a KV
        `cache` (`jaxllm.infer.kv_cache.CacheView`, returned updated) and `logits_at_BxQ`, the
        positions along L whose logits it needs, so a long prefill never materialises [B, L, V]
        logits. `dropout_key` (training) turns on dropout when `cfg.dropout` > 0. `aux` holds
        the MoE load statistics (see `ModelOutput`); {} for dense models. `token_types_BxL`:
        the token types of a model with `cfg.encoder.type_vocab_size` (default 0).
        `prefix_BxL` (prefix LM, training and scoring): 1 where a token belongs to its
        segment's prefix, which attends bidirectionally within itself (attention on xla).
        `hidden_only`: return the LM head's input as `hidden` and no logits (a loss computed in
        chunks calls `head_logits` per chunk). `hidden_states`: also return every block's
        output, [N, B, L, D] (the scans' outputs; feature distillation reads them).
        With `cfg.rope.mrope_section`, `positions_BxL` may also be [3, B, L] (M-RoPE rows).
        `deepstack`: a vision tower's DeepStack inputs (`jaxllm.model.deepstack`).
        """
        if (tokens_BxL is None) == (embeddings_BxLxD is None):
            raise ValueError("pass exactly one of tokens_BxL and embeddings_BxLxD")
        x_BxLxD, positions_BxL, segment_ids_BxL, keys = self.inputs(
            tokens_BxL,
            positions_BxL,
            segment_ids_BxL,
            embeddings_BxLxD,
            dropout_key,
            token_types_BxL,
        )
        cfg = self.cfg
        per_layer = self.per_layer(keys, cache is not None)
        remat = cache is None and cfg.remat not in (
            "none",
            "auto",
        )  # auto: resolved before training
        carry = (x_BxLxD, cache, *deepstack_lib.carry(deepstack))
        n_dense = dense_layers(cfg)
        where = (positions_BxL, segment_ids_BxL, remat, prefix_BxL, hidden_states)
        kept = []  # with hidden_states: the blocks' outputs, [N, B, L, D] per scan
        if self.layers is not None:
            take = jax.tree.map(lambda a: a[:n_dense], per_layer)
            carry, ys = self.scan(self.layers, carry, take, *where)
            kept += [ys[1]] if hidden_states else []
        aux = {}
        if cfg.layer_pattern:
            carry, ys = hybrid.scan(self, self.hybrid_layers, carry, per_layer, *where)
            stats, kept = (ys[0], [*kept, ys[1]]) if hidden_states else (ys, kept)
            aux = moe_lib.combine_layer_stats(stats) if cfg.moe.enabled else {}
        elif cfg.moe.enabled:
            rest = jax.tree.map(lambda a: a[n_dense:], per_layer)
            carry, ys = self.moe_scan(self.moe_layers, carry, rest, *where)
            stats, kept = (ys[0], [*kept, ys[1]]) if hidden_states else (ys, kept)
            aux = moe_lib.combine_layer_stats(stats)
        x_BxLxD, cache = carry[:2]
        pooled_BxD = None
        if cfg.encoder.pooler:  # of each row's first token, whatever logits are asked for
            first_Bx1xD = x_BxLxD[:, :1]
            if cfg.norm_placement != "post":
                first_Bx1xD = self.final_norm(first_Bx1xD)
            pooled_BxD = self.pooler(first_Bx1xD)
        if logits_at_BxQ is not None:
            x_BxLxD = jnp.take_along_axis(x_BxLxD, logits_at_BxQ[:, :, None], axis=1)
        out = self.outputs(x_BxLxD, cache, aux, pooled_BxD, hidden_only)
        return out._replace(hidden_states=jnp.concatenate(kept)) if hidden_states else out

    def inputs(
        self,
        tokens_BxL,
        positions_BxL,
        segment_ids_BxL,
        embeddings_BxLxD,
        dropout_key,
        token_types_BxL=None,
    ):
        """(x, positions, segment ids, per-layer dropout keys or None): the input of the first
        block, from tokens or embeddings (with an encoder's token types), with the default
        positions and segment ids."""
        cfg = self.cfg
        if embeddings_BxLxD is None:
            embeddings_BxLxD = self._embed(tokens_BxL)
        b, l = embeddings_BxLxD.shape[:2]
        if positions_BxL is None:
            positions_BxL = default_positions(cfg, b, l)
        if segment_ids_BxL is None:
            segment_ids_BxL = jnp.ones((b, l), jnp.int32)
        dtype = jnp.dtype(cfg.dtype)
        x_BxLxD = embeddings_BxLxD.astype(dtype)
        if cfg.scale_embeddings:  # in the compute dtype, as Gemma does
            x_BxLxD = x_BxLxD * jnp.asarray(math.sqrt(cfg.d_model), dtype)
        if cfg.position == "learned":
            rows_BxL = positions_BxL + cfg.encoder.position_offset
            pos_BxLxD = jnp.take(self.pos_embed[...], rows_BxL, axis=0, mode="clip")
            x_BxLxD = x_BxLxD + pos_BxLxD.astype(dtype)
        x_BxLxD = self._encoder_embeddings(x_BxLxD, token_types_BxL)
        keys = None
        if dropout_key is not None and (cfg.dropout > 0 or getattr(self, "lora_dropout", 0.0)):
            embed_key, layers_key = jax.random.split(dropout_key)
            x_BxLxD = apply_dropout(x_BxLxD, cfg.dropout, embed_key)
            keys = jax.random.split(layers_key, cfg.num_layers)
        x_BxLxD = constrain(x_BxLxD, ("batch", "res_length", "act_embed"))
        return x_BxLxD, positions_BxL, segment_ids_BxL, keys

    def per_layer(self, keys, with_cache: bool = False) -> dict:
        """Per-layer inputs of the scan, arrays over all N layers: when layers differ their
        window flag and dropout key; with a cache, the layer index."""
        cfg = self.cfg
        windows = cfg.layer_windows()
        per_layer = {
            "windowed": None
            if windows is None or cfg.global_every == 0
            else jnp.asarray(windows, jnp.int32) > 0,
            "key": keys,
        }
        if with_cache:  # hybrid: full and linear layers count apart (their caches differ)
            kinds = layer_kinds(cfg)
            index = [kinds[:i].count(kind) for i, kind in enumerate(kinds)]
            per_layer["layer"] = jnp.asarray(index, jnp.int32)
        return {k: v for k, v in per_layer.items() if v is not None}

    def outputs(
        self, x_BxLxD, cache=None, aux=None, pooled_BxD=None, hidden_only=False
    ) -> ModelOutput:
        """The model's output from the last block's output: final norm, then the head (and an
        encoder's MLM transform); `pooled_BxD`: the pooler's output, passed through.
        `hidden_only`: no logits; `hidden` holds the head's input (for `head_logits`)."""
        cfg, aux, dtype = self.cfg, aux or {}, jnp.dtype(self.cfg.dtype)
        if cfg.norm_placement != "post":
            x_BxLxD = self.final_norm(x_BxLxD)
        if cfg.encoder.mlm_head:
            x_BxLxD = self.mlm_transform(x_BxLxD)
        if cfg.head == "score":  # [B, L, 1] scores, in float32 as logits
            scores_BxLx1 = matmul("bld,do->blo", x_BxLxD, self.score[...], dtype, jnp.float32)
            if cfg.score_bias:
                scores_BxLx1 = scores_BxLx1 + self.score_bias[...].astype(jnp.float32)[None, None]
            return ModelOutput(constrain(scores_BxLx1, ("batch", "length", None)), cache, aux)
        values_BxL = None
        if cfg.value_head:
            values_BxL = matmul("bld,do->blo", x_BxLxD, self.value[...], dtype, jnp.float32)[..., 0]
        if hidden_only:
            return ModelOutput(None, cache, aux, values_BxL, pooled_BxD, x_BxLxD)
        return ModelOutput(self.head_logits(x_BxLxD), cache, aux, values_BxL, pooled_BxD)

    def head_logits(self, x_BxLxD) -> jax.Array:
        """float32 logits [B, L, V] of the LM head from its input (after the final norm): tied
        or separate head, an encoder's output bias, the final soft cap."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        if cfg.tie_embeddings:
            logits_BxLxV = self.embed.attend(x_BxLxD)
        else:
            head = lora.kernel(self, "lm_head")
            logits_BxLxV = matmul("bld,dv->blv", x_BxLxD, head, dtype, jnp.float32)
        if cfg.encoder.mlm_head:
            logits_BxLxV = logits_BxLxV + self.lm_bias[...].astype(jnp.float32)[None, None]
        if cfg.final_soft_cap is not None:
            cap = jnp.float32(cfg.final_soft_cap)
            logits_BxLxV = cap * jnp.tanh(logits_BxLxV / cap)
        return constrain(logits_BxLxV, ("batch", "length", "act_vocab"))

    def _encoder_embeddings(self, x_BxLxD, token_types_BxL):
        """The embeddings with an encoder's token types added and its embedding norm applied
        (`cfg.encoder`); unchanged without them."""
        if hasattr(self, "type_embed"):
            if token_types_BxL is None:
                type_1x1xD = self.type_embed[...][0][None, None]
                x_BxLxD = x_BxLxD + type_1x1xD.astype(x_BxLxD.dtype)
            else:
                types_BxLxD = jnp.take(self.type_embed[...], token_types_BxL, axis=0)
                x_BxLxD = x_BxLxD + types_BxLxD.astype(x_BxLxD.dtype)
        if hasattr(self, "embed_norm"):
            x_BxLxD = self.embed_norm(x_BxLxD)
        return x_BxLxD

    def _embed(self, tokens_BxL):
        """Token embeddings; with a soft prompt (peft.method=prompt), the ids -1 .. -P are its
        virtual tokens 0 .. P-1 (the data pipeline and `generate` put them before each
        example)."""
        prompt = getattr(self, "soft_prompt", None)
        if prompt is None:
            return self.embed(tokens_BxL)
        virtual_BxL = tokens_BxL < 0
        x_BxLxD = self.embed(jnp.where(virtual_BxL, 0, tokens_BxL))
        index_BxL = jnp.clip(-tokens_BxL - 1, 0, prompt.shape[0] - 1)
        v_BxLxD = jnp.take(prompt[...], index_BxL, axis=0).astype(x_BxLxD.dtype)
        return jnp.where(virtual_BxL[..., None], v_BxLxD, x_BxLxD)

    def after_step(self, model_state: dict, stats: dict, keep: jax.Array):
        """(new non-trained model state, metrics) after a train step, from the step's summed
        `stats` (the `model_stats` of its objective: MoE expert loads). `keep`: whether the
        step was finite; otherwise the state stays. No stats: nothing changes."""
        if not stats:
            return model_state, {}
        return moe_lib.after_step(self.cfg.moe, model_state, stats, keep)

    def moe_scan(
        self,
        groups,
        carry,
        per_layer,
        positions_BxL,
        segment_ids_BxL,
        remat,
        prefix_BxL=None,
        keep=False,
    ):
        """(carry, stacked stats of each MoE layer) of a scan over a stack of `MoEGroup`s
        (moe_every - 1 dense blocks, then an MoE block) with their layers' inputs
        (`per_layer`, one entry per layer); with `keep`, (carry, (stats, every block's output
        [N_groups * moe_every, B, L, D]))."""
        every = self.cfg.moe.moe_every
        per_group = jax.tree.map(lambda a: a.reshape(-1, every, *a.shape[1:]), per_layer)
        group_def, group_state = nnx.split(groups)

        def group_body(carry, xs):
            state, inputs = xs
            group = nnx.merge(group_def, state)
            kept = []
            if group.dense is not None:
                dense_in = jax.tree.map(lambda a: a[:-1], inputs)
                where = (positions_BxL, segment_ids_BxL, remat, prefix_BxL, keep)
                carry, ys = self.scan(group.dense, carry, dense_in, *where)
                kept = [ys[1]] if keep else []
            moe_in = jax.tree.map(lambda a: a[-1], inputs)
            moe_def, moe_state = nnx.split(group.moe)
            body = self._body(moe_def, positions_BxL, segment_ids_BxL, prefix_BxL, remat, keep)
            carry, ys = body(carry, (moe_state, moe_in))
            return carry, (ys[0], jnp.concatenate([*kept, ys[1][None]])) if keep else ys

        carry, ys = jax.lax.scan(
            group_body, carry, (group_state, per_group), unroll=self.cfg.scan_unroll
        )
        if keep:  # [groups, moe_every, B, L, D] -> one block per row
            ys = (ys[0], ys[1].reshape(-1, *ys[1].shape[2:]))
        return carry, ys

    def _body(self, graphdef, positions_BxL, segment_ids_BxL, prefix_BxL, remat: bool, keep=False):
        """Scan body of one block: ((x, cache), (state, per-layer inputs)) -> ((x, cache),
        stats), with `keep` ((x, cache), (stats, x)); the cache (when there is one) is pointed
        at the block's own layer."""

        def body(carry, xs):
            x_BxLxD, cache, *deep = carry
            state, inputs = xs
            inputs = dict(inputs)
            layer = inputs.pop("layer", None)
            view = None if cache is None else cache.at_layer(layer)
            block = nnx.merge(graphdef, state)
            x_BxLxD, view, stats = block(
                x_BxLxD, positions_BxL, segment_ids_BxL, view, prefix_BxL=prefix_BxL, **inputs
            )
            x_BxLxD, deep = deepstack_lib.add(x_BxLxD, deep)
            return (x_BxLxD, view, *deep), ((stats, x_BxLxD) if keep else stats)

        if remat:
            body = jax.checkpoint(body, policy=policy(self.cfg.remat), prevent_cse=False)
        return body

    def scan(
        self,
        stack,
        carry,
        per_layer,
        positions_BxL,
        segment_ids_BxL,
        remat: bool,
        prefix_BxL=None,
        keep=False,
    ):
        """Runs the blocks of a stacked module in order; returns the carry and stacked stats
        (with `keep`, (stats, each block's output [N, B, L, D]))."""
        graphdef, state = nnx.split(stack)
        body = self._body(graphdef, positions_BxL, segment_ids_BxL, prefix_BxL, remat, keep)
        return jax.lax.scan(body, carry, (state, per_layer), unroll=self.cfg.scan_unroll)


# model.kind -> its module class when not `Transformer` (`encoder_decoder` registers itself on
# import; `jaxllm.model` imports it); "vision": a decoder with `model.vision` (`vlm`).
MODEL_KINDS: dict[str, type] = {}


def model_class(cfg: ModelConfig) -> type:
    """The module class of `cfg.kind` (of a decoder with a vision tower)."""
    if cfg.vision is not None:
        return MODEL_KINDS["vision"]
    return MODEL_KINDS.get(cfg.kind, Transformer)


def build(cfg: ModelConfig, seed: int | jax.Array = 0, peft: PeftConfig | None = None):
    """A freshly initialised model (on the default device), with `peft`'s parts attached."""
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    model = model_class(cfg)(cfg, rngs=nnx.Rngs(params=key))
    if cfg.fp8 == "delayed":  # amax histories beside the projections, in the model state
        fp8_delayed.attach(model, cfg.fp8_amax_history)
    attach_peft(model, peft, key)
    return model


def init_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """(the parameters' init key, the train state's rng key) of a run's seed."""
    return tuple(jax.random.split(jax.random.key(seed)))


def split_peft(model: Transformer, peft: PeftConfig | None):
    """(graphdef, trainable params, frozen params, model state) as pure dicts: every parameter
    trains without `peft`, else its adapters / soft prompt, and the frozen base is as the train
    state keeps it (`lora.freeze`: NF4 under QLoRA); frozen is None without peft."""
    if peft is None or peft.method == "none":
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return graphdef, nnx.to_pure_dict(params), None, nnx.to_pure_dict(rest)
    graphdef, params, frozen, rest = nnx.split(model, lora.trainable(peft), nnx.Param, ...)
    frozen = lora.freeze(nnx.to_pure_dict(frozen), logical_axes(frozen), peft)
    return graphdef, nnx.to_pure_dict(params), frozen, nnx.to_pure_dict(rest)


def merge_model(graphdef, params, frozen=None, model_state=None) -> nnx.Module:
    """The model of these parameters, frozen base (peft) and model state (either may be
    None / empty)."""
    return nnx.merge(graphdef, params, *(s for s in (frozen, model_state) if s))


def attach_peft(model: Transformer, peft: PeftConfig | None, key: jax.Array) -> None:
    """Adds `peft`'s trainable parts to a model built from `key` (their own stream of it): LoRA
    adapters, bottleneck adapters (`bottleneck.attach`), or the soft prompt, initialised as the
    embeddings of random vocabulary tokens (`lora.prompt_token_ids`)."""
    if peft is None or peft.method == "none":
        return
    key = lora.peft_key(key)
    if peft.method == "prompt":
        ids = lora.prompt_token_ids(key, peft.num_virtual_tokens, model.cfg.vocab_size)
        init = model.embed.embedding[...][ids]
        model.soft_prompt = lora.PromptParam(init, axes=("virtual_tokens", "embed"))
    elif peft.method == "adapter":
        bottleneck.attach(model, peft, key)
    else:
        lora.attach(model, peft, key)
