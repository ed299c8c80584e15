"""Reference models for the Hugging Face conversion tests: for each family a tiny model built
by `transformers` (CPU torch, no download) with every weight perturbed, and the helpers that
save it, run it and run `jaxllm convert`."""

from pathlib import Path

import numpy as np
import torch
import transformers as hf

from jaxllm import cli

REPO = Path(__file__).resolve().parents[1]
VOCAB, LEN = 320, 20
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# DeepSeek-V3 MLA in small: a kv latent of 16, a query latent of 24, heads of 16 + 8 RoPE
# query/key channels and 12 value channels; first_k_dense_replace = layers: every block dense.
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    first_k_dense_replace=2,
)
# ... and its MoE blocks after one dense block: 8 experts in 2 groups, top-2 from the best group,
# a shared expert, and YaRN with DeepSeek's mscale / mscale_all_dim (unequal, so both the
# cos/sin factor and the softmax scale move).
DEEPSEEK_MOE = dict(
    MLA,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    moe_intermediate_size=32,
    routed_scaling_factor=2.5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
)
# DeepSeek-V2-Lite in small: no query latent, plain top-2 of 8 softmax-scored experts (weights
# not renormalised), two shared experts, YaRN with the released mscale = mscale_all_dim; and a
# DeepSeek-V2 with a query latent and group_limited_greedy (top-2 within the best of 2 groups,
# groups ranked by their highest score), unequal mscales and routed_scaling_factor 2.
DEEPSEEK_V2_LITE = dict(
    MLA,
    q_lora_rank=None,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=2,
    moe_intermediate_size=32,
    topk_method="greedy",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
)
DEEPSEEK_V2_GROUPS = dict(
    DEEPSEEK_MOE,
    topk_method="group_limited_greedy",
    norm_topk_prob=False,
    routed_scaling_factor=2.0,
)

FAMILIES = {
    "llama2": (hf.LlamaConfig, hf.LlamaForCausalLM, dict(num_key_value_heads=4)),
    "llama3.1": (
        hf.LlamaConfig,
        hf.LlamaForCausalLM,
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    "llama-yarn": (
        hf.LlamaConfig,
        hf.LlamaForCausalLM,
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    "mistral": (hf.MistralConfig, hf.MistralForCausalLM, dict(sliding_window=6)),
    "mixtral": (
        hf.MixtralConfig,
        hf.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
    ),
    "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM, dict(head_dim=32)),
    "gemma2": (
        hf.Gemma2Config,
        hf.Gemma2ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    # Gemma 3: a sliding then a global layer, each with its own RoPE (linear scaling global only)
    "gemma3_text": (
        hf.Gemma3TextConfig,
        hf.Gemma3ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            },
        ),
    ),
    "deepseek_v3-dense": (hf.DeepseekV3Config, hf.DeepseekV3ForCausalLM, MLA),
    "deepseek_v3-dense-q_lora_none-rotate_half": (
        hf.DeepseekV3Config,
        hf.DeepseekV3ForCausalLM,
        dict(MLA, q_lora_rank=None, rope_interleave=False),
    ),
    "deepseek_v3": (hf.DeepseekV3Config, hf.DeepseekV3ForCausalLM, DEEPSEEK_MOE),
    "deepseek_v2-lite": (hf.DeepseekV2Config, hf.DeepseekV2ForCausalLM, DEEPSEEK_V2_LITE),
    "deepseek_v2-groups": (hf.DeepseekV2Config, hf.DeepseekV2ForCausalLM, DEEPSEEK_V2_GROUPS),
    "gpt2": (
        hf.GPT2Config,
        hf.GPT2LMHeadModel,
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB),
    ),
}


def hf_model(family: str, seed: int = 0):
    cls_cfg, cls_model, extra = FAMILIES[family]
    kwargs = extra if family == "gpt2" else {**SMALL, **extra}
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**kwargs, attn_implementation="eager")).eval()
    with torch.no_grad():  # perturb everything: zero biases / unit norms would hide mistakes
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias is a saved buffer
            if name.endswith("e_score_correction_bias"):
                b.add_(0.05 * torch.randn_like(b))
    return model


def save_hf(model, path):
    model.save_pretrained(path)
    return path


def sample_tokens(seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (2, LEN))


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def run_cli(*argv):
    return cli.main([str(a) for a in argv])


def stderr_of_failure(capsys, *argv) -> str:
    assert run_cli(*argv) == cli.EXIT_USER_ERROR
    return capsys.readouterr().err
