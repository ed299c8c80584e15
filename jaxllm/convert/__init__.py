"""Hugging Face checkpoints in and out: Llama (2, 3, 3.1/3.2 RoPE scaling), Mistral, Mixtral,
Qwen2, Qwen3, Gemma 2, DeepSeek-V3, GPT-2, and the encoders BERT and RoBERTa (MLM heads), as
safetensors + config.json.

    jaxllm convert import HF_DIR OUT_DIR [key=value ...]     # a run directory
    jaxllm convert export RUN_DIR|CHECKPOINT HF_DIR [--family NAME]
    (LoRA adapters as Hugging Face PEFT's files: `--peft`, in `jaxllm.adapters.hf_peft`)

`families.py` is the registry of families (mappings in `llama.py`, `gemma.py`, `gpt2.py`,
`deepseek.py`, `bert.py`, built from `links.py` and `config_map.py`), `reader.py` reads config.json and
safetensors, `mapping.py` checks a family's layout against the files, `hf.py` streams the import
(every parameter created in its shards on the mesh), `export.py` writes the export, `cli.py` is
the command. `jaxllm.load_model(HF_DIR)` (`jaxllm/load.py`) loads a Hugging Face directory
directly and `checkpoint.init_from=...` starts training from one.
"""

from __future__ import annotations

from jaxllm.convert.export import export_hf
from jaxllm.convert.families import FAMILIES
from jaxllm.convert.hf import import_hf, load_params, model_config
from jaxllm.convert.reader import is_hf_dir

__all__ = [
    "FAMILIES",
    "export_hf",
    "import_hf",
    "is_hf_dir",
    "load_params",
    "model_config",
]
