"""Decode speed of a trained model at a long context, on this machine (docs/experiments.md,
full attention vs the 3:1 Gated DeltaNet hybrid).

    python scripts/hybrid_decode_timing.py RUN_DIR [--context 8192 32768] [--steps 64]
        [--generate-prompt 2048]

Two measurements, each after a compile-and-warm-up call:

- `decode at C`: the cache of `jaxllm.infer.generate` (bfloat16 KV for the full-attention
  layers, the fixed-size recurrent state for the linear ones) set up as if C tokens had been
  prefilled, then `--steps` greedy decode steps of one sequence in one jitted loop, the same
  model call and cache view as generate's decode loop. The cached keys and values are zeros
  rather than a real prefill's: a decode step reads all C of them either way, so its cost is
  the same, and no C-token prefill (whose XLA attention scores are C x C per head) is needed.
- `generate`: `jaxllm.infer.generate` end to end on a prompt of `--generate-prompt` tokens
  (prefill + decode), with max_new_tokens 1 and 1 + steps; the difference over `steps` is the
  real decode loop's time per token.

Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxllm
from jaxllm.config import GenerateConfig
from jaxllm.infer import kv_cache, linear_state
from jaxllm.infer.generate import generate


def _decode_loop(graphdef, state, kv, linear, lengths_B, tok_B, steps: int):
    model = nnx.merge(graphdef, state)

    def body(_, carry):
        tok_B, lengths_B, kv, linear = carry
        lengths_B = lengths_B + 1
        view = kv_cache.CacheView(kv, lengths_B, jnp.int32(0), prefill=False, linear=linear)
        logits_Bx1xV, view, *_ = model(
            tok_B[:, None], positions_BxL=(lengths_B - 1)[:, None], cache=view
        )
        return jnp.argmax(logits_Bx1xV[:, 0], -1).astype(jnp.int32), lengths_B, view.kv, view.linear

    return jax.lax.fori_loop(0, steps, body, (tok_B, lengths_B, kv, linear))[0]


decode_loop = jax.jit(_decode_loop, static_argnames=("graphdef", "steps"))


def time_decode(model, context: int, steps: int) -> dict:
    cfg = model.cfg
    g, k, value_dim = kv_cache.cache_dims(cfg)
    max_len = kv_cache.cache_length(context + steps, "bfloat16", 32)
    kv = kv_cache.init_cache(
        num_layers=linear_state.num_full_layers(cfg),
        batch=1,
        num_kv_heads=g,
        head_dim=k,
        max_len=max_len,
        compute_dtype=jnp.dtype(cfg.dtype),
        value_dim=value_dim,
    )
    linear = linear_state.init_linear_state(cfg, 1)
    graphdef, state = nnx.split(model)
    lengths_B = jnp.full((1,), context, jnp.int32)
    tok_B = jnp.full((1,), 10, jnp.int32)
    args = (graphdef, state, kv, linear, lengths_B, tok_B, steps)
    t0 = time.perf_counter()
    decode_loop(*args).block_until_ready()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    decode_loop(*args).block_until_ready()
    warm = time.perf_counter() - t0
    kv_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(kv))
    lin_bytes = linear_state.state_bytes(cfg, 1) if linear is not None else 0
    return dict(
        what="decode",
        context=context,
        steps=steps,
        ms_per_token=1e3 * warm / steps,
        tokens_per_s=steps / warm,
        first_call_s=first,
        kv_cache_bytes=kv_bytes,
        kv_cache_tokens=max_len,
        linear_state_bytes=lin_bytes,
    )


def time_generate(model, prompt_len: int, steps: int) -> dict:
    prompt = [list(np.random.default_rng(0).integers(32, 127, prompt_len))]
    out = {}
    for new in (1, 1 + steps):
        gen = GenerateConfig(max_new_tokens=new, temperature=0.0)
        generate(model, prompt, gen)  # compile and warm up
        t0 = time.perf_counter()
        generate(model, prompt, gen)
        out[new] = time.perf_counter() - t0
    per_token = (out[1 + steps] - out[1]) / steps
    return dict(
        what="generate",
        prompt_tokens=prompt_len,
        steps=steps,
        prefill_plus_one_token_s=out[1],
        ms_per_token=1e3 * per_token,
        tokens_per_s=1 / per_token,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--generate-prompt", type=int, default=0, help="0: skip")
    args = parser.parse_args()
    longest = max([*args.context, args.generate_prompt]) + args.steps + 64
    model = jaxllm.load_model(args.run_dir, overrides=[f"model.max_seq_len={longest}"])
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(json.dumps(dict(run=args.run_dir, params=params, device=str(jax.devices()[0]))))
    for c in args.context:
        print(json.dumps(time_decode(model, c, args.steps)), flush=True)
    if args.generate_prompt:
        print(json.dumps(time_generate(model, args.generate_prompt, args.steps)), flush=True)


if __name__ == "__main__":
    main()
