"""Build tiny GPTQ / AWQ 4-bit reference checkpoints with GPTQModel on CPU.

Usage:  python make_fixtures.py [float|gptq_sym|gptq_asym|awq|refs|all]

Outputs (next to this file):
  float/            tiny random LlamaForCausalLM (fp16, safetensors) + tokenizer
  gptq4_g32_sym/    GPTQ v1 checkpoint, 4-bit, group 32, sym=True,  desc_act=False
  gptq4_g32_asym/   GPTQ v1 checkpoint, 4-bit, group 32, sym=False, desc_act=False
  awq4_g32/         AWQ GEMM checkpoint, 4-bit, group 32, zero_point=True
Each quantized dir also gets reference.safetensors (see README.md).
"""

import glob
import json
import os
import shutil
import sys

# GPTQModel's loader pool asks for 2 CPU workers; the default pool size is
# ceil(cpu_count / 2), which is 1 on a 2-core host and makes load() fail.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import torch

OUT = os.path.dirname(os.path.abspath(__file__))
FLOAT_DIR = os.path.join(OUT, "float")
VOCAB = 320
LOGIT_IDS = torch.arange(16)[None] * 7 % VOCAB


def make_float():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).to(torch.float16).eval()
    shutil.rmtree(FLOAT_DIR, ignore_errors=True)
    model.save_pretrained(FLOAT_DIR, safe_serialization=True)

    # Minimal word-level tokenizer ("t0" .. "t319") so that loaders which
    # insist on a tokenizer can find one next to the weights.
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="t0",
        bos_token="t1",
        eos_token="t2",
        unk_token="t3",
    )
    fast.save_pretrained(FLOAT_DIR)


def calibration():
    # 16 sequences x 64 random token ids (ids 0..3 are special, skip them).
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(4, VOCAB, (16, 64), generator=g)
    return [{"input_ids": r.tolist(), "attention_mask": [1] * r.numel()} for r in ids]


def tidy(out_dir):
    # Keep only what a loader needs.
    for pattern in ("quant_log.csv", "*.bin", "optimizer*", "training_args*"):
        for p in glob.glob(os.path.join(out_dir, pattern)):
            os.remove(p)
    # The temp offload path recorded in meta is machine specific: drop it.
    for name in ("config.json", "quantize_config.json"):
        path = os.path.join(out_dir, name)
        with open(path) as f:
            cfg = json.load(f)
        qc = cfg.get("quantization_config", cfg)
        qc.get("meta", {}).pop("offload_to_disk_path", None)
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")


def quantize(name, qcfg):
    from gptqmodel import GPTQModel

    out_dir = os.path.join(OUT, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    torch.manual_seed(0)
    model = GPTQModel.load(FLOAT_DIR, qcfg, device="cpu", dtype=torch.float16)
    model.quantize(calibration(), batch_size=1)
    model.save(out_dir)
    del model
    tidy(out_dir)
    return out_dir


def reference(name):
    """Dequantized weights + logits computed by GPTQModel's own torch kernels."""
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import save_file

    out_dir = os.path.join(OUT, name)
    with open(os.path.join(out_dir, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    is_awq = qc["quant_method"] == "awq"
    backend = BACKEND.AWQ_TORCH if is_awq else BACKEND.GPTQ_TORCH

    tensors = {}
    model = GPTQModel.load(out_dir, device="cpu", backend=backend, dtype=torch.float16)
    model.model.eval()
    n = 0
    for mod_name, mod in model.model.named_modules():
        if is_awq and isinstance(mod, AwqTorchLinear):
            # AWQ GEMM: dequantize_gemm -> [in, out]; fp32 scales keep it exact.
            w = dequantize_gemm(
                mod.qweight, mod.qzeros, mod.scales.float(), mod.bits, mod.group_size
            )
        elif not is_awq and isinstance(mod, TorchLinear):
            # GPTQ: TorchLinear.dequantize_weight() -> [in, out] in scales dtype.
            # Run it with fp32 scales so the reference is the exact product.
            s16 = mod.scales
            mod.scales = s16.float()
            w = mod.dequantize_weight()
            mod.scales = s16
        else:
            continue
        tensors[mod_name + ".weight"] = w.T.contiguous().to(torch.float32)
        n += 1
    assert n == 14, n

    with torch.no_grad():
        logits = model.model(input_ids=LOGIT_IDS).logits
    tensors["logits"] = logits.to(torch.float32).contiguous()
    del model

    # Same network in plain fp32: the checkpoint's non-quantized tensors
    # (embeddings, norms, lm_head) + the dequantized weights above, run by
    # transformers' LlamaForCausalLM.  Tighter target than the fp16 logits.
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(out_dir)
    del cfg.quantization_config
    dense = LlamaForCausalLM(cfg).float().eval()
    state = {
        k: v.float()
        for k, v in load_file(os.path.join(out_dir, "model.safetensors")).items()
        if k.endswith(".weight")
    }
    state.update({k: v for k, v in tensors.items() if k != "logits"})
    dense.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits32 = dense(input_ids=LOGIT_IDS).logits
    tensors["logits_fp32"] = logits32.contiguous()
    print(
        name,
        "logits",
        tuple(logits.shape),
        logits.dtype,
        "max|fp16 kernel - fp32 dense|",
        float((logits.float() - logits32).abs().max()),
    )
    # No header metadata: safetensors writes it in hash order, which would make
    # the file bytes differ between runs.
    save_file(tensors, os.path.join(out_dir, "reference.safetensors"))


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    # GPTQModel writes run logs to ./logs; keep them out of the fixture tree.
    import tempfile

    os.chdir(tempfile.mkdtemp(prefix="gptq-fixtures-run-"))
    if what in ("float", "all"):
        make_float()
    if what in ("gptq_sym", "all"):
        from gptqmodel import GPTQConfig

        quantize(
            "gptq4_g32_sym",
            GPTQConfig(bits=4, group_size=32, sym=True, desc_act=False, offload_to_disk=False),
        )
    if what in ("gptq_asym", "all"):
        from gptqmodel import GPTQConfig

        quantize(
            "gptq4_g32_asym",
            GPTQConfig(bits=4, group_size=32, sym=False, desc_act=False, offload_to_disk=False),
        )
    if what in ("awq", "all"):
        from gptqmodel import AWQConfig
        from gptqmodel.looper.awq_processor import AWQProcessor

        # AWQ's clip search (_compute_best_clip) asserts out_features % 64 == 0,
        # which k_proj/v_proj (out = 2 kv heads * 16 = 32) do not satisfy.
        # Turn clipping off (AutoAWQ's `apply_clip=False`); scale search and
        # packing are unchanged.
        _orig_init = AWQProcessor.__init__

        def _init_no_clip(self, *a, **kw):
            _orig_init(self, *a, **kw)
            self.apply_clip = False

        AWQProcessor.__init__ = _init_no_clip
        from gptqmodel.quantization import FORMAT

        # sym=False is GPTQModel's spelling of AutoAWQ's zero_point=True.
        quantize(
            "awq4_g32",
            AWQConfig(bits=4, group_size=32, sym=False, format=FORMAT.GEMM, offload_to_disk=False),
        )
    if what in ("refs", "all"):
        for name in ("gptq4_g32_sym", "gptq4_g32_asym", "awq4_g32"):
            if os.path.isdir(os.path.join(OUT, name)):
                reference(name)
