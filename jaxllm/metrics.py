"""Metrics out of a run: JSONL + TensorBoard writers, the loss plot, FLOPs and MFU."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path

from jaxllm.config import JaxllmWarning, ModelConfig

# Dense bf16 peak FLOP/s per chip, by `jax.Device.device_kind` prefix (vendor data sheets).
PEAK_FLOPS = {
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
}


def peak_flops(device_kind: str) -> float | None:
    for prefix in sorted(PEAK_FLOPS, key=len, reverse=True):
        if device_kind.startswith(prefix):
            return PEAK_FLOPS[prefix]
    return None


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the config: total; active (what one token uses: of an MoE layer's
    experts only the top-k routed ones); and matmul (the active ones in matmuls, for FLOPs)."""
    d, f, n = cfg.d_model, cfg.mlp_dim, cfg.num_layers
    hk, gk = cfg.num_heads * cfg.resolved_head_dim, cfg.num_kv_heads * cfg.resolved_head_dim
    mlp_mats = 3 if cfg.gated_mlp else 2
    attn = d * hk * (3 if cfg.attn_output_gate else 2) + d * gk * 2
    mla_norms = 0
    if cfg.mla.enabled:
        a, h = cfg.mla, cfg.num_heads
        q = (
            d * a.q_lora_rank + a.q_lora_rank * h * a.qk_head_dim
            if a.q_lora_rank
            else d * h * a.qk_head_dim
        )
        kv = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * h * (
            a.qk_nope_head_dim + a.v_head_dim
        )
        attn, mla_norms = q + kv + h * a.v_head_dim * d, n * (a.q_lora_rank + a.kv_lora_rank)
    n_lin, lin_mats, lin_other = _linear_layer_params(cfg)
    attn_all = (n - n_lin) * attn + n_lin * lin_mats  # token mixers of every block
    n_moe, moe_total, moe_active = 0, 0, 0
    moe_bias_total, moe_bias_active = 0, 0
    if cfg.moe.enabled:  # experts and shared experts are SwiGLU FFNs
        m, fe = cfg.moe, cfg.resolved_expert_mlp_dim
        n_moe = n if cfg.layer_pattern else (n - m.first_dense_layers) // m.moe_every
        shared = 3 * d * (m.shared_mlp_dim or fe * m.num_shared_experts) + d * m.shared_expert_gate
        common = d * m.num_experts + shared  # router, shared experts (and their gate)
        moe_total = common + 3 * d * fe * m.num_experts
        moe_active = common + 3 * d * fe * m.experts_per_token
        # gpt-oss: the router's logit bias, each expert's gate / up / down biases
        per_expert = (2 * fe + d) * m.expert_bias
        moe_bias_total = n_moe * (m.num_experts * (m.router_logit_bias + per_expert))
        moe_bias_active = n_moe * (m.num_experts * m.router_logit_bias)
        moe_bias_active += n_moe * m.experts_per_token * per_expert
    dense_layer = mlp_mats * d * f
    total_matmul = (n - n_moe) * dense_layer + n_moe * moe_total + attn_all
    active_matmul = (n - n_moe) * dense_layer + n_moe * moe_active + attn_all
    embed = cfg.vocab_size * d
    head_out = 1 if cfg.head == "score" else cfg.vocab_size  # a reward model's one score
    head = 0 if cfg.tie_embeddings else head_out * d
    norm_params = 2 if cfg.norm == "layernorm" else 1  # scale (and bias) per channel
    norms_per_layer = 4 if cfg.norm_placement == "sandwich" else 2
    final_norms = 0 if cfg.norm_placement == "post" else 1
    norms = (
        norm_params
        * (
            (norms_per_layer * n + final_norms) * d
            + (2 * (n - n_lin) * cfg.resolved_head_dim if cfg.qk_norm else 0)
            + mla_norms
        )
        + n_lin * lin_other
    )
    biases = n * (
        (hk + 2 * gk) * cfg.qkv_bias + d * cfg.o_bias + ((mlp_mats - 1) * f + d) * cfg.mlp_bias
    )
    biases += n * cfg.num_heads * cfg.attention_sinks  # one sink logit per query head
    positions = cfg.max_seq_len * d if cfg.position == "learned" else 0
    enc = cfg.encoder  # an encoder's BERT parts: token types, embedding norm, MLM head, pooler
    transform = (d * d + d + norm_params * d) * enc.mlm_head
    extra = (
        enc.type_vocab_size * d
        + norm_params * d * enc.embed_norm
        + (transform + cfg.vocab_size) * enc.mlm_head
        + (d * d + d) * enc.pooler
    )
    tower = vision_params(cfg.vision)  # per image, not per token: in total alone
    return {
        "total": total_matmul
        + embed
        + head
        + norms
        + biases
        + moe_bias_total
        + positions
        + extra
        + tower,
        "vision": tower,
        "active": active_matmul
        + embed
        + head
        + norms
        + biases
        + moe_bias_active
        + positions
        + extra,
        # the LM head is a matmul (the tied embedding too); the input embedding is a gather
        "matmul": active_matmul + head_out * d + d * d * enc.mlm_head,
    }


def vision_params(v) -> int:
    """Parameters of the vision tower (`model.vision`; 0 without one): the patch embedding,
    each block's two RMSNorms, attention (q, k, v, o with biases) and SwiGLU MLP with biases,
    and the merger (RMSNorm, fc1 and fc2 with biases)."""
    if v is None:
        return 0
    d, f, wide = v.width, v.mlp_dim, v.width * v.spatial_merge**2
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * d
    block = 2 * d + 4 * (d * d + d) + 3 * d * f + 2 * f + d
    merger = d + wide * wide + wide + wide * v.out_dim + v.out_dim
    return patch + v.depth * block + merger


def _linear_layer_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """(linear-attention blocks, matmul parameters of one, its other parameters: conv
    filters, A_log, dt_bias, the gated norm's scale)."""
    la = cfg.linear_attention
    n_lin = (
        sum(
            cfg.layer_pattern[i % len(cfg.layer_pattern)] == "linear" for i in range(cfg.num_layers)
        )
        if cfg.layer_pattern
        else 0
    )
    qk, vz, h = la.num_k_heads * la.k_head_dim, la.num_v_heads * la.v_head_dim, la.num_v_heads
    mats = cfg.d_model * (2 * qk + 2 * vz + 2 * h) + vz * cfg.d_model
    return n_lin, mats, la.conv_kernel * (2 * qk + vz) + 2 * h + la.v_head_dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token (forward + backward = 3x forward), Kaplan/PaLM style:
    6 * active matmul params (of MoE layers only the routed top-k experts), plus attention
    scores and values 6 * layers * heads * (qk head dim + v head dim) * seq (full, unmasked
    L x S products, which is what the XLA implementation computes)."""
    dense = 6 * param_counts(cfg)["matmul"]
    k = v = cfg.resolved_head_dim
    if cfg.mla.enabled:
        k, v = cfg.mla.qk_head_dim, cfg.mla.v_head_dim
    n_lin = _linear_layer_params(cfg)[0]
    attn = 6 * (cfg.num_layers - n_lin) * cfg.num_heads * (k + v) * seq_len
    if n_lin:  # chunked delta rule: C x (K + V) inside a chunk, three [K, V] state products
        la = cfg.linear_attention
        kd, vd, c = la.k_head_dim, la.v_head_dim, min(la.chunk_size, seq_len)
        attn += 6 * n_lin * la.num_v_heads * (c * (kd + vd) + 3 * kd * vd)
    return {"dense": float(dense), "attention": float(attn), "total": float(dense + attn)}


class MetricsWriter:
    """One JSON object per line in metrics.jsonl, and the same scalars to TensorBoard and to
    the `sinks` (`jaxllm.trackers`: W&B, MLflow).

    Each line is written whole with one `write` and flushed, so a crash leaves at most a torn
    last line, which `read_jsonl` drops with a warning."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        resume_step: int = 0,
        resume_row: dict | None = None,
        tensorboard: bool = True,
        sinks: list | None = None,
    ):
        """A run resumed at `resume_step` keeps the lines up to that step and drops later ones
        (written by the attempt that died after its last checkpoint); a fresh run starts empty.
        `resume_row`: the row of `resume_step` that its checkpoint saved, added back when the
        file lacks it (a crash tore it, as the last line). The kept lines are written to a
        temporary file that replaces the old one, so a crash here loses nothing. `sinks`:
        objects with `write(step, row)` and `finish(summary, files)`, which fail quietly."""
        self.path = Path(run_dir) / "metrics.jsonl"
        kept = []
        if resume_step and self.path.exists():
            kept = [r for r in read_jsonl(self.path) if r.get("step", 0) <= resume_step]
        if resume_row and resume_row.get("step") == resume_step:
            if not any(r.get("step") == resume_step and _same_kind(r, resume_row) for r in kept):
                kept.append(resume_row)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")
        self._tb = None
        self._sinks = list(sinks or ())
        if tensorboard:
            self._tb = _summary_writer_class()(str(Path(run_dir) / "tensorboard"))

    def write(self, step: int, values: dict) -> None:
        row = {"step": int(step), **{k: _py(v) for k, v in values.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        for sink in self._sinks:
            sink.write(step, row)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def finish(self, summary: dict, files: list[Path]) -> None:
        """Ends the sinks' runs with the closing `summary` and the `files` (loss.png) as
        artifacts; after `close`, once the run's last output is written."""
        sinks, self._sinks = self._sinks, []  # ended: a later `fail` has none to end
        for sink in sinks:
            sink.finish(summary, files)

    def fail(self, error: BaseException) -> None:
        """Ends the sinks' runs as failed by `error` (killed, for an interrupt); metrics.jsonl
        stays as written."""
        if not self._file.closed:
            self.close()
        for sink in self._sinks:
            sink.fail(error)


def _summary_writer_class():
    """tensorboardX's SummaryWriter. Its import pulls in torch where torch is installed (about
    1.5 s at every start) only to accept torch tensors; the writer logs Python floats here, so
    unless torch is already loaded it is imported with `import torch` failing, as without torch."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


def _same_kind(a: dict, b: dict) -> bool:
    """Whether two rows of one step are the same record (not, say, an event row beside it)."""
    return set(a) == set(b)


def _py(v):
    try:
        return v.item()
    except AttributeError:
        return v


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a metrics file; a line that is not a JSON object (a crash tore the last one)
    is dropped with a JaxllmWarning."""
    rows = []
    for n, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            warnings.warn(
                f"{path}:{n} is not a whole JSON line (a crash tore it?); dropped it.",
                JaxllmWarning,
                stacklevel=2,
            )
            continue
        rows.append(row)
    return rows


def plot_losses(metrics_path: str | Path, out_path: str | Path) -> None:
    """Train loss (every log line) and eval loss (every eval line) against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.axhline(math.log(256), color="gray", ls=":", label="uniform bytes (ln 256)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
