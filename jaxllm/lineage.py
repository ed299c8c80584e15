"""Does model B descend from model A's initialisation? SeedPrints (Tong et al. 2025,
arXiv 2509.26404): a randomly initialised language model fed uniformly random tokens already
prefers some next tokens over others, a token-selection bias fixed by its init seed, and that
bias survives training well enough to be measured on the trained model.

Our reading of the method, on probes every model sees alike:

- probes: `probes` sequences of `length` tokens drawn uniformly from the vocabulary by a fixed
  seed (no data, so no domain the models were trained on); at every probe position, the
  logits minus their mean over the vocabulary;
- token bias (SeedPrints' statistic): each token's centred logit averaged over all probe
  positions, bias_V; Kendall's tau of A's and B's over the V tokens, one-sided (a descendant
  keeps A's preferences, so tau > 0), p from tau's normal approximation under independence;
- token co-preference (our addition, same probes): the correlation of every two tokens' logits
  across the probe positions ([T, T] for T <= 512 tokens the probe seed picks). It is the
  geometry of the output embedding as the outputs show it, W^T Cov(h) W, and it outlasts
  training better than the mean, which moves with the mean hidden state. A's and B's
  matrices are compared by a Mantel test: the correlation r of their off-diagonal entries,
  against the same with B's tokens relabelled at random (`permutations` times), p from the
  normal approximation of that null.

B descends from A when the smaller p, doubled (Bonferroni over the two), is below `alpha`.
On the small runs of docs/experiments.md, the token bias alone fades within tens of steps at
lr 1e-3 while co-preference holds; at lr 1e-2 both are nearly gone after 30 steps.

A's side of the test is A's *initialisation* where it can be rebuilt: a jaxllm run that started
from its seed (`run.seed`, no `checkpoint.init_from`, no adapters) is rebuilt from that seed,
so what both models learned from shared data (the corpus' token frequencies and token
geometry) cannot pass for kinship. Otherwise (a Hugging Face directory, a run started from
other weights) A's own weights stand in, as for released models; two models trained on the
same data then share a data signal that this test reads as kinship (`reference` in the result
says which side was used), so that mode is sound for untrained or lightly trained A only.

The unembedding correlation (A's and B's output embedding, flattened) is reported as
parameter-space evidence; it does not vote.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy import stats

from jaxllm import config
from jaxllm.config import ConfigError
from jaxllm.convert import is_hf_dir
from jaxllm.load import load_model, model_section, resolve
from jaxllm.model import abstract_model, build, init_keys

PROBES = 64
LENGTH = 32
PROBE_SEED = 0
ALPHA = 1e-3
MATRIX_TOKENS = 512
PERMUTATIONS = 200


@dataclasses.dataclass(frozen=True)
class Side:
    """One model of the comparison: its path, model section, and what the test reads of it."""

    path: str
    model_cfg: config.ModelConfig
    seed: int | None  # the init seed to rebuild from; None: its weights are the reference


def describe(path) -> Side:
    """A run directory / checkpoint or a Hugging Face directory -> its Side; ConfigError when
    it is neither, or when its model is not a decoder (the probes are next-token logits)."""
    path = Path(path)
    model_cfg = model_section(path, "lineage")
    if model_cfg.kind != "decoder":
        raise ConfigError(f"{path} is a {model_cfg.kind} model; lineage reads decoders only.")
    if model_cfg.head != "lm":
        raise ConfigError(f"{path} ends in a {model_cfg.head} head; lineage reads LM heads only.")
    seed = None
    if not is_hf_dir(path):
        run = config.load(resolve(path)[0] / "config.yaml")
        if not run.checkpoint.init_from and run.peft.method == "none":
            seed = run.run.seed
    return Side(str(path), model_cfg, seed)


def check_same_shape(a: Side, b: Side) -> None:
    """ConfigError naming the first parameter whose shape differs between A and B."""

    def shapes(cfg):
        flat = jax.tree_util.tree_flatten_with_path(abstract_model(cfg)[1])[0]
        return {"/".join(str(k.key) for k in p): tuple(x.shape) for p, x in flat}

    sa, sb = shapes(a.model_cfg), shapes(b.model_cfg)
    if sa != sb:
        name = sorted(set(sa.items()) ^ set(sb.items()))[0][0]
        raise ConfigError(
            f"lineage compares models of one shape; {a.path} and {b.path} differ (first: {name}: "
            f"{sa.get(name)} vs {sb.get(name)})."
        )


def init_model(model_cfg: config.ModelConfig, seed: int) -> nnx.Module:
    """The model a run of this seed started from (the train state's init stream)."""
    return build(model_cfg, init_keys(seed)[0])


def probe_tokens(vocab: int, max_len: int, probes=PROBES, length=LENGTH, seed=PROBE_SEED):
    """[probes, length] int32 tokens, uniform over the vocabulary."""
    shape = (probes, min(length, max_len))
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, jnp.int32)


def matrix_tokens(vocab: int, seed=PROBE_SEED, most=MATRIX_TOKENS) -> np.ndarray:
    """The tokens of the co-preference matrix: all, or `most` of them drawn by `seed`."""
    if vocab <= most:
        return np.arange(vocab)
    return np.sort(np.random.default_rng(seed).choice(vocab, most, replace=False))


class Fingerprint(NamedTuple):
    bias_V: np.ndarray  # each token's centred logit, averaged over the probe positions
    corr_TxT: np.ndarray  # the correlation of the `matrix_tokens` logits over the positions


def fingerprint(model: nnx.Module, tokens_BxL, picked_T, batch: int = 16) -> Fingerprint:
    """The model's logits on the probes, reduced to its Fingerprint."""
    picked_T = jnp.asarray(picked_T)

    @nnx.jit
    def centred(m, t_BxL):
        logits_BxLxV = m(t_BxL).logits.astype(jnp.float32)
        logits_BxLxV = logits_BxLxV - logits_BxLxV.mean(-1, keepdims=True)
        return logits_BxLxV.sum((0, 1)), logits_BxLxV[..., picked_T].reshape(-1, len(picked_T))

    sums, rows = [], []
    for i in range(0, tokens_BxL.shape[0], batch):
        total_V, rows_NxT = jax.device_get(centred(model, tokens_BxL[i : i + batch]))
        sums.append(np.asarray(total_V, np.float64))
        rows.append(np.asarray(rows_NxT, np.float64))
    bias_V = np.sum(sums, axis=0) / tokens_BxL.size
    with np.errstate(invalid="ignore", divide="ignore"):  # a constant token: no correlation
        corr_TxT = np.nan_to_num(np.corrcoef(np.concatenate(rows).T))
    return Fingerprint(bias_V, corr_TxT)


def kendall(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(tau-b, one-sided p-value of tau > 0) from scipy's O(n log n) Kendall tau."""
    r = stats.kendalltau(x, y, alternative="greater")
    tau, p = float(r.statistic), float(r.pvalue)
    return (tau, p) if math.isfinite(p) else (0.0, 1.0)


def mantel(a_TxT, b_TxT, permutations=PERMUTATIONS, seed=PROBE_SEED) -> tuple[float, float]:
    """(r, one-sided p of r > 0): the correlation of two matrices' off-diagonal entries, its
    p from a normal fitted to the r of `permutations` random relabellings of b's tokens."""
    iu = np.triu_indices(a_TxT.shape[0], 1)
    a = a_TxT[iu] - a_TxT[iu].mean()
    a = a / (np.linalg.norm(a) or 1.0)

    def r(b_TxT):
        b = b_TxT[iu] - b_TxT[iu].mean()
        return float(a @ b / (np.linalg.norm(b) or 1.0))

    rng = np.random.default_rng(seed)
    null = []
    for _ in range(permutations):
        perm = rng.permutation(b_TxT.shape[0])
        null.append(r(b_TxT[perm][:, perm]))
    observed, sd = r(b_TxT), float(np.std(null))
    if sd == 0.0:
        return observed, 1.0
    return observed, float(stats.norm.sf((observed - np.mean(null)) / sd))


def unembedding(model: nnx.Module) -> np.ndarray:
    """The output embedding [V, D] (the tied input table when the model has no head)."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    head = params.get("lm_head")
    if hasattr(head, "ndim") and head.ndim == 2:  # [D, V]
        return np.asarray(jax.device_get(head), np.float64).T
    return np.asarray(jax.device_get(params["embed"]["embedding"]), np.float64)


def lineage(
    path_a, path_b, *, probes=PROBES, length=LENGTH, probe_seed=PROBE_SEED, alpha=ALPHA,
    reference: str = "auto",
) -> dict:  # fmt: skip
    """The verdict on B descending from A's initialisation, with its statistics and p-values
    (see the module docstring). `reference`: `auto` (A's init where it can be rebuilt, else
    its weights), `init` (ConfigError when A's seed is not known) or `weights`."""
    a, b = describe(path_a), describe(path_b)
    check_same_shape(a, b)
    if reference == "init" and a.seed is None:
        raise ConfigError(
            f"{a.path} did not start from a seed of its own (a Hugging Face directory, a run "
            "from checkpoint.init_from or with adapters); use --reference weights or auto."
        )
    use_init = a.seed is not None and reference != "weights"
    model_a = init_model(a.model_cfg, a.seed) if use_init else load_model(a.path)
    model_b = load_model(b.path)
    cfg = a.model_cfg
    tokens = probe_tokens(cfg.vocab_size, cfg.max_seq_len, probes, length, probe_seed)
    picked = matrix_tokens(cfg.vocab_size, probe_seed)
    fa, fb = fingerprint(model_a, tokens, picked), fingerprint(model_b, tokens, picked)
    out = compare(fa, fb, alpha, probe_seed)
    ua, ub = unembedding(model_a).ravel(), unembedding(model_b).ravel()
    return {
        "a": a.path,
        "b": b.path,
        **out,
        "reference": f"init (seed {a.seed})" if use_init else "weights",
        "tokens": int(cfg.vocab_size),
        "matrix_tokens": len(picked),
        "probes": int(tokens.shape[0]),
        "length": int(tokens.shape[1]),
        "probe_seed": probe_seed,
        "unembedding_corr": float(np.corrcoef(ua, ub)[0, 1]),
    }


def compare(fa: Fingerprint, fb: Fingerprint, alpha=ALPHA, seed=PROBE_SEED) -> dict:
    """The two tests on two fingerprints and the verdict (module docstring)."""
    tau, p_bias = kendall(fa.bias_V, fb.bias_V)
    r, p_matrix = mantel(fa.corr_TxT, fb.corr_TxT, seed=seed)
    p = min(1.0, 2 * min(p_bias, p_matrix))
    return {
        "descends": p < alpha,
        "p_value": p,
        "alpha": alpha,
        "bias_tau": tau,
        "bias_p": p_bias,
        "copreference_r": r,
        "copreference_p": p_matrix,
    }


def format_result(r: dict) -> str:
    """The verdict line, then the evidence."""
    verdict = "descends from" if r["descends"] else "does not descend from"
    return (
        f"{r['b']} {verdict} {r['a']}'s initialisation (p = {r['p_value']:.3g}, alpha "
        f"{r['alpha']:g}; reference: A's {r['reference']})\n"
        f"  token bias (SeedPrints): Kendall tau {r['bias_tau']:+.4f} over {r['tokens']} "
        f"tokens, p = {r['bias_p']:.3g}\n"
        f"  token co-preference: Mantel r {r['copreference_r']:+.4f} over "
        f"{r['matrix_tokens']} tokens, p = {r['copreference_p']:.3g}\n"
        f"  ({r['probes']} random probes x {r['length']} tokens, probe seed "
        f"{r['probe_seed']}); unembedding correlation {r['unembedding_corr']:+.4f}"
    )
