"""Statistics of the inputs of chosen weights, recorded while a model runs: what calibrated
quantization (`jaxllm.compress.calibrate`: GPTQ's Hessians, AWQ's and SmoothQuant's per-channel
activation magnitudes) needs of its calibration data.

`recording(names)` is used inside a traced function: `names` maps the `id` of a weight value
(as the model reads it, `lora.kernel`) to its name. While it is active, `layers.matmul` hands
every input whose kernel is named here to `see`, and the MoE layer hands its experts' routed
inputs to `add`. Each weight's statistics are, over its input rows x (vectors of its K
contracted channels, flattened as the weight's rows are), per leading weight dim (experts):

    gram [*lead, K, K] = sum x x^T     abs_sum [*lead, K] = sum |x|
    abs_max [*lead, K] = max |x|       count [*lead] = number of rows

in float32. The function returns `Recorder.stats`, whose values are then ordinary outputs of
the trace; nothing is recorded outside `recording`.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("tap", default=None)


class Recorder:
    def __init__(
        self, names: dict[int, str], mask_T: jax.Array | None = None, keep: frozenset = frozenset()
    ):
        self.names = names
        self.keep = keep  # names whose inputs themselves are kept too, as "x" [K, T]
        self.mask_T = mask_T  # 1 where a token counts (not padding), over the batch's B * L
        self.stats: dict[str, dict[str, jax.Array]] = {}
        self.claimed: set[str] = set()  # recorded by their layer (`claim`), not by `see`

    def name(self, kernel) -> str | None:
        return self.names.get(id(kernel))

    def add(self, name: str, x_KxT: jax.Array, mask_T: jax.Array | None = None, raw=None) -> None:
        """Adds rows: `x_KxT` [*lead, K, T] (T rows of K channels), `mask_T` [*lead, T] (1
        where a row counts); with `name` in `keep`, the input itself (`raw`, default x_KxT)
        is kept as "x" (of one call: a layer's weight reads one input per run)."""
        x = x_KxT.astype(jnp.float32)
        if mask_T is None:
            mask_T = jnp.ones((*x.shape[:-2], x.shape[-1]), jnp.float32)
        xm = x * mask_T[..., None, :].astype(jnp.float32)
        new = {
            "gram": jnp.einsum("...kt,...jt->...kj", xm, x, preferred_element_type=jnp.float32),
            "abs_sum": jnp.sum(jnp.abs(xm), axis=-1),
            "abs_max": jnp.max(jnp.abs(xm), axis=-1),
            "count": jnp.sum(mask_T.astype(jnp.float32), axis=-1),
        }
        old = self.stats.get(name)
        self.stats[name] = new if old is None else {**old, **merge(old, new)}
        if name in self.keep:
            self.stats[name].setdefault("x", x_KxT if raw is None else raw)

    def claim(self, kernel) -> str | None:
        """The name of `kernel`, whose layer records its rows itself (`add`): `see` then
        leaves it alone (the MoE's experts, whose matmuls see dispatch buffers)."""
        name = self.name(kernel)
        if name is not None:
            self.claimed.add(name)
        return name

    def see(self, spec: str, x: jax.Array, kernel) -> None:
        """The input `x` of `einsum(spec, x, kernel)`, when `kernel` is named."""
        name = self.name(kernel)
        if name is None or name in self.claimed:
            return
        ins, out = spec.split("->")
        xs, ks = ins.split(",")
        contracted = "".join(c for c in ks if c in xs and c not in out)
        lead = "".join(c for c in ks if c in xs and c in out)
        rows = "".join(c for c in xs if c not in ks)
        x_t = jnp.einsum(f"{xs}->{lead}{contracted}{rows}", x)
        n_lead = len(lead)
        k = 1
        for d in x_t.shape[n_lead : n_lead + len(contracted)]:
            k *= d
        x_t = x_t.reshape(*x_t.shape[:n_lead], k, -1)
        mask = self.mask_T
        self.add(name, x_t, mask if mask is not None and mask.size == x_t.shape[-1] else None)


def merge(a: dict, b: dict) -> dict:
    """Statistics of the rows of both."""
    return {
        "gram": a["gram"] + b["gram"],
        "abs_sum": a["abs_sum"] + b["abs_sum"],
        "abs_max": jnp.maximum(a["abs_max"], b["abs_max"]),
        "count": a["count"] + b["count"],
    }


def active() -> Recorder | None:
    return _ACTIVE.get()


@contextlib.contextmanager
def recording(names: dict[int, str], mask_T: jax.Array | None = None, keep=frozenset()):
    """Records the inputs of the weights `names` names (module docstring); `mask_T`: the
    tokens that count, as the model's [B, L] flattened; `keep`: names whose inputs are kept
    whole too."""
    rec = Recorder(names, mask_T, frozenset(keep))
    token = _ACTIVE.set(rec)
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)
