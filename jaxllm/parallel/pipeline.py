"""One executor for every pipeline schedule: a `lax.scan` over the ticks of a schedule table
(`jaxllm.parallel.schedules`) inside a `shard_map` manual over the `stage` mesh axis only (the
other axes, data / fsdp / tensor / sequence, stay automatic inside each stage).

At each tick every stage looks up its own entry of the table and runs it (`lax.switch`):

- F: the stage function on the input in its slot (the first virtual stage embeds the
  microbatch's tokens instead; the last one computes the head and the objective's sums);
- BW: `jax.vjp` of the stage function at the stored input, which recomputes the stage's forward
  (remat at stage granularity; the model's own remat policy still applies inside it), with
  respect to the input and the stage's parameters at once;
- B / W (zero bubble): the same vjp with respect to the input only, or the parameters only;

then sends its output to the next stage and its input gradient to the previous one
(`lax.ppermute`, both every tick), and the receivers store what arrives in the slot the table
names. Each virtual stage's backward seeds its loss output with `seed` (1, or the loss scale):
the last stage's is the objective's, the others' are 0 or their own terms (MoE balancing).
Weight gradients add up in float32 over the microbatches.

Parameters come as (stack, rest) pairs: stack leaves have the layer axis first ([N, ...], split
over `stage`), the rest (embedding, head, final norm) enters every stage whole, its
gradient summed over them at the end. With v virtual stages the stack is viewed as
[v, p, N / (p v), ...], so device s holds chunks s, s + p, ... (circular); DualPipeV's V flips
the second row, so that device d holds chunks d and 2p - 1 - d. DualPipe's stack is viewed as
[2, p, N / p, ...], its second row the first reversed: device d holds stage d for the
microbatches going down and stage p - 1 - d for those going up, and the two copies' gradients
are summed. Both send activations also to the previous stage and gradients to the next (the
second leg of the V, the way up): two more permutes per tick; DualPipeV's stage p - 1 keeps
what it sends itself between its two chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm import sharding
from jaxllm.parallel import schedules as S

SEND_AXES = ("batch", "length", "act_mlp")  # the activations between stages


def _tree_zeros(tree, dtype=None):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, dtype or a.dtype), tree)


def _add(acc, delta):
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, delta)


def run(table: S.Table, stage_fn, train, const, *, mesh, act, sums_like, seed):
    """(gradients of `train` in float32, summed `sums`) of the schedule `table`.

    `stage_fn((stack chunk, rest), const, x, mb, c) -> ((y, loss), sums)` runs virtual stage `c`
    on microbatch `mb` (traced ints); `train` = (stack, rest) are differentiated, `const` =
    (stack, rest) are not (a frozen base, the batch, keys). `act`: the ShapeDtypeStruct of an
    activation, `sums_like`: the structure of `sums`."""
    p, v = table.stages, table.virtual
    last = table.chunks - 1
    v_shape, dual = table.schedule == "dualpipev", table.schedule == "dualpipe"

    def flip(a):  # the V: device d's second chunk is 2p - 1 - d (an involution)
        return jnp.concatenate([a[:1], a[1:, ::-1]]) if v_shape else a

    def to_chunks(a):
        if dual:  # device d: stage d for the way down, stage p - 1 - d for the way up
            a = a.reshape(p, a.shape[0] // p, *a.shape[1:])
            return jnp.stack([a, a[::-1]])
        return flip(a.reshape(v, p, a.shape[0] // (p * v), *a.shape[1:]))

    def from_chunks(d):  # the gradient of to_chunks
        if dual:
            return (d[0] + d[1, ::-1]).reshape(-1, *d.shape[3:])
        return flip(d).reshape(-1, *d.shape[3:])

    def chunk_spec(tree):
        return jax.tree.map(lambda _: P(None, "stage"), tree)

    def rest_spec(tree):
        return jax.tree.map(lambda _: P(), tree)

    train = (jax.tree.map(to_chunks, train[0]), train[1])
    const = (jax.tree.map(to_chunks, const[0]), const[1])
    in_specs = (
        (chunk_spec(train[0]), rest_spec(train[1])),
        (chunk_spec(const[0]), rest_spec(const[1])),
        P(),
        P(),
    )
    out_specs = ((chunk_spec(train[0]), rest_spec(train[1])), rest_spec(sums_like))
    actions = jnp.asarray(table.actions)

    def body(train, const, actions, seed):
        stage = jax.lax.axis_index("stage")
        squeeze = lambda tree: jax.tree.map(lambda a: a[:, 0], tree)  # noqa: E731
        (t_stack, t_rest), (c_stack, c_rest) = (squeeze(train[0]), train[1]), const
        c_stack = squeeze(c_stack)

        def at(tree, j):
            return jax.tree.map(lambda a: a[j], tree)

        zeros_act = sharding.constrain(jnp.zeros(act.shape, act.dtype), SEND_AXES)
        carry = {
            "x": sharding.constrain(
                jnp.zeros((table.x_slots, *act.shape), act.dtype), (None, *SEND_AXES)
            ),
            "g": sharding.constrain(
                jnp.zeros((table.grad_slots, *act.shape), act.dtype), (None, *SEND_AXES)
            ),
            "d_stack": _tree_zeros(t_stack, jnp.float32),
            "d_rest": _tree_zeros(t_rest, jnp.float32),
            "sums": _tree_zeros(sums_like),
        }

        def tick(carry, rows):
            kind, mb, j, xs, gs = (rows[stage, f] for f in range(S.RECV_X))
            j, xs, gs = (jnp.maximum(a, 0) for a in (j, xs, gs))
            if v_shape or dual:
                c = jnp.where(j == 0, stage, last - stage if dual else 2 * p - 1 - stage)
            else:
                c = j * p + stage
            cst = (at(c_stack, j), c_rest)

            def f(params, x):
                return stage_fn(params, cst, x, mb, c)

            def grads_in(carry):
                x = carry["x"][xs]
                g_y = jnp.where(c < last, carry["g"][gs], zeros_act)
                # every stage's loss is seeded: the last one's objective, and any stage's own
                # terms (an MoE block's balancing losses)
                g_loss = jnp.asarray(seed, jnp.float32)
                return x, (g_y, g_loss)

            def add_weights(carry, d):
                d_chunk, d_rest = d
                carry = dict(carry)
                carry["d_stack"] = jax.tree.map(
                    lambda acc, g: acc.at[j].add(g.astype(acc.dtype)), carry["d_stack"], d_chunk
                )
                carry["d_rest"] = _add(carry["d_rest"], d_rest)
                return carry

            def idle(carry):
                return carry, zeros_act, zeros_act

            def fwd(carry):
                (y, _), sums = f((at(t_stack, j), t_rest), carry["x"][xs])
                carry = dict(carry, sums=_add(carry["sums"], sums))
                return carry, y.astype(act.dtype), zeros_act

            def bwd_input(carry):
                x, cot = grads_in(carry)
                params = (at(t_stack, j), t_rest)
                _, vjp = jax.vjp(lambda x: f(params, x)[0], x)
                return carry, zeros_act, vjp(cot)[0].astype(act.dtype)

            def bwd_weights(carry):
                x, cot = grads_in(carry)
                _, vjp = jax.vjp(lambda params: f(params, x)[0], (at(t_stack, j), t_rest))
                return add_weights(carry, vjp(cot)[0]), zeros_act, zeros_act

            def bwd_both(carry):
                x, cot = grads_in(carry)
                _, vjp = jax.vjp(lambda params, x: f(params, x)[0], (at(t_stack, j), t_rest), x)
                d_params, d_x = vjp(cot)
                return add_weights(carry, d_params), zeros_act, d_x.astype(act.dtype)

            carry, send_f, send_b = jax.lax.switch(
                kind, [idle, fwd, bwd_input, bwd_weights, bwd_both], carry
            )
            # split over every automatic axis: XLA's SPMD partitioner fails on a permute of a
            # buffer split over some axes (data) and replicated over others (tensor)
            send_f, send_b = (sharding.constrain(a, SEND_AXES) for a in (send_f, send_b))
            down = [(i, (i + 1) % p) for i in range(p)]
            up = [(i, (i - 1) % p) for i in range(p)]
            arrivals = [
                ("x", S.RECV_X, jax.lax.ppermute(send_f, "stage", down)),
                ("g", S.RECV_G, jax.lax.ppermute(send_b, "stage", up)),
            ]
            if v_shape or dual:
                arrivals += [
                    ("x", S.RECV_X_UP, jax.lax.ppermute(send_f, "stage", up)),
                    ("g", S.RECV_G_DOWN, jax.lax.ppermute(send_b, "stage", down)),
                ]
            if v_shape:
                arrivals += [("x", S.KEEP_X, send_f), ("g", S.KEEP_G, send_b)]
            carry = dict(carry)
            for name, field, got in arrivals:
                slot = rows[stage, field]
                safe = jnp.maximum(slot, 0)
                buf = carry[name]
                buf = buf.at[safe].set(jnp.where(slot >= 0, got, buf[safe]))
                carry[name] = sharding.constrain(buf, (None, *SEND_AXES))
            return carry, None

        carry, _ = jax.lax.scan(tick, carry, actions)
        d_rest = jax.lax.psum(carry["d_rest"], "stage")
        sums = jax.lax.psum(carry["sums"], "stage")
        d_stack = jax.tree.map(lambda a: a[:, None], carry["d_stack"])
        return (d_stack, d_rest), sums

    run_stages = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={"stage"},
        check_vma=False,
    )
    (d_stack, d_rest), sums = run_stages(train, const, actions, jnp.asarray(seed, jnp.float32))
    d_stack = jax.tree.map(from_chunks, d_stack)
    return (d_stack, d_rest), sums
