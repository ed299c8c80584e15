"""Typed, frozen run configuration: one dataclass per component, YAML files, key=value overrides.

The dataclasses below are the single source of truth for every key: their defaults *are* the
default run (`jaxllm train` with no arguments), each field is documented where it is declared,
and YAML files under `configs/` only override them.

    cfg = jaxllm.config.load("configs/runs/default.yaml", ["train.steps=20", "mesh=fsdp"])

A YAML file may hold `include: [other.yaml, ...]` (paths relative to the including file, merged in
order, the including file winning). A section may be named by preset instead of spelled out:
`model: llama3_8b` (in YAML or as an override `model=llama3_8b`) loads `configs/models/llama3_8b.yaml`.

User mistakes raise `ConfigError` with one sentence naming the key and the fix; the CLI turns it
into exit code 2 before anything is compiled.

Modules: `model` (the model section), `train`, `peft`, `quantize`, `sections` (the others), `trackers`
(`run.trackers` and the W&B / MLflow keys), `root` (`Config` and the cross-section checks),
`loading` (YAML, presets, overrides, type checks), `errors`.
"""

from jaxllm.config.checkpoint import CheckpointConfig
from jaxllm.config.encoder import EncoderConfig
from jaxllm.config.errors import ConfigError, JaxllmWarning, RunError
from jaxllm.config.linear_attention import LinearAttentionConfig
from jaxllm.config.loading import (
    SECTIONS,
    apply_overrides,
    configs_dir,
    dump,
    from_dict,
    load,
    load_args,
    split_args,
    to_dict,
)
from jaxllm.config.model import MLAConfig, ModelConfig, RopeConfig
from jaxllm.config.moe import MoEConfig
from jaxllm.config.optim import OPTIM_READS, OptimConfig
from jaxllm.config.peft import PeftConfig
from jaxllm.config.prune import PruneConfig
from jaxllm.config.quantize import QuantizeConfig
from jaxllm.config.root import Config
from jaxllm.config.sections import (
    MESH_AXES,
    DataConfig,
    GenerateConfig,
    MeshConfig,
    RunConfig,
    SourceConfig,
    mesh_degrees,
)
from jaxllm.config.train import TrainConfig

__all__ = [
    "MESH_AXES",
    "OPTIM_READS",
    "SECTIONS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "GenerateConfig",
    "QuantizeConfig",
    "PruneConfig",
    "JaxllmWarning",
    "LinearAttentionConfig",
    "MLAConfig",
    "MeshConfig",
    "ModelConfig",
    "MoEConfig",
    "EncoderConfig",
    "OptimConfig",
    "PeftConfig",
    "RopeConfig",
    "RunConfig",
    "RunError",
    "SourceConfig",
    "TrainConfig",
    "apply_overrides",
    "configs_dir",
    "dump",
    "from_dict",
    "load",
    "load_args",
    "mesh_degrees",
    "split_args",
    "to_dict",
]
