"""`attention_impl=cudnn` on CPU: the packed-segment offsets cuDNN takes, and what `auto` picks
on each platform. The cuDNN call itself needs a GPU (tests/test_gpu.py, marked gpu)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ConfigError, ModelConfig
from jaxllm.model.attention import resolve_impl
from jaxllm.model.cudnn import segment_offsets


def _runs(row):
    """(start, length) of each run of equal ids, by a plain loop."""
    runs, start = [], 0
    for i in range(1, len(row) + 1):
        if i == len(row) or row[i] != row[i - 1]:
            runs.append((start, i - start))
            start = i
    return runs


@pytest.mark.parametrize("m", [1, 3, 8, 40])
def test_segment_offsets_match_the_runs_of_each_row(m):
    rng = np.random.default_rng(m)
    rows = []
    for _ in range(6):  # documents of random lengths, then padding (id 0) or not
        lengths = rng.integers(1, 12, size=rng.integers(1, 7))
        ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)[:40]
        rows.append(np.pad(ids, (0, 40 - len(ids))))
    seg = np.stack(rows).astype(np.int32)
    lengths, offsets, count = (np.asarray(a) for a in segment_offsets(jnp.asarray(seg), m))
    assert lengths.shape == (6, m) and offsets.shape == (6, m + 1)
    for b, row in enumerate(seg):
        runs = _runs(row.tolist())
        assert count[b] == len(runs)
        kept = runs[:m]
        want_off = [s for s, _ in kept] + [-1] * (m + 1 - len(kept))
        want_len = [n for _, n in kept] + [-1] * (m - len(kept))
        if len(runs) > m:  # cut at M: the caller falls back; only the kept runs are checked
            want_off[m] = runs[m][0]
            want_len[m - 1] = runs[m][0] - runs[m - 1][0]
        assert offsets[b].tolist() == want_off, (b, row)
        assert lengths[b].tolist() == want_len, (b, row)


@pytest.mark.parametrize(
    "platform,kwargs,want",
    [
        ("gpu", {"dtype": jnp.bfloat16}, "cudnn"),
        ("gpu", {"dtype": jnp.float16}, "cudnn"),
        ("gpu", {"dtype": jnp.bfloat16, "soft_cap": True}, "flash"),
        ("gpu", {"dtype": jnp.float32}, "xla"),
        ("gpu", {"dtype": jnp.bfloat16, "alibi": True}, "xla"),
        ("gpu", {"dtype": jnp.bfloat16, "head_dim": 64}, "cudnn"),
        ("gpu", {"dtype": jnp.bfloat16, "head_dim": 192}, "xla"),  # MLA's q/k width
        ("gpu", {"dtype": jnp.bfloat16, "causal": False}, "flash"),  # an encoder
        ("tpu", {"dtype": jnp.bfloat16}, "flash"),
        ("tpu", {"alibi": True}, "xla"),
        ("cpu", {"dtype": jnp.bfloat16}, "xla"),
    ],
)
def test_auto_picks_the_fastest_measured_implementation(monkeypatch, platform, kwargs, want):
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    assert resolve_impl("auto", **kwargs) == want
    for impl in ("xla", "flash", "cudnn"):  # an explicit choice is kept
        assert resolve_impl(impl, **kwargs) == impl


def test_max_segments_must_be_positive():
    with pytest.raises(ConfigError, match="cudnn_max_segments"):
        ModelConfig(cudnn_max_segments=0).validate()
