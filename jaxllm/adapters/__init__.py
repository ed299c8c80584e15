"""Parameter-efficient fine-tuning at the run level: the adapters in and out of Hugging Face
PEFT's layout (`hf_peft`), a run started from a fine-tuning run, merged or continuing its
adapters (`chain`), and the names of a run's base record (which live in `jaxllm.load`, where
every reader of a run loads the base; `base_record` here also knows a continued run's).

The model side lives in `jaxllm.model.lora` (adapters on weights) and the `peft` config
section in `jaxllm.config.peft`; the train step is the one of pretraining, differentiating only
what trains (`TrainState.params`) with the base held in `TrainState.frozen`.
"""

from jaxllm.adapters.chain import (
    base_record,
    continued,
    pruned_base,
    quantized_base,
    starting_weights,
)
from jaxllm.adapters.hf_peft import export_peft, import_peft, imported_adapters
from jaxllm.load import BASE_ITEM, check_base, load_frozen

__all__ = [
    "BASE_ITEM",
    "base_record",
    "check_base",
    "continued",
    "export_peft",
    "import_peft",
    "imported_adapters",
    "load_frozen",
    "quantized_base",
    "pruned_base",
    "starting_weights",
]
