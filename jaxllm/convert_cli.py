"""`jaxllm convert import|export`: Hugging Face checkpoints to run directories and back.

Both print one line per mapped tensor (Hugging Face name, layers, our parameters, shapes,
dtype) to stdout; a tensor that maps to nothing, a missing one, a shape mismatch, a broken file
(config.json, index, safetensors) or a knob the target family cannot express is a ConfigError
(one line, exit 2) before anything is written. The tokenizer and its special-token ids travel
both ways (tokenizer.json, tokenizer_config.json, special_tokens_map.json, the chat template,
generation_config.json).
"""

from __future__ import annotations

import argparse
import sys

from jaxllm import sharding
from jaxllm.config import ConfigError, MeshConfig
from jaxllm.convert import FAMILIES, export_hf, import_hf
from jaxllm.load import resolve, restore


def cmd_import(ns: argparse.Namespace) -> int:
    overrides = [a for a in ns.overrides]
    if any("=" not in a for a in overrides):
        raise ConfigError(
            "jaxllm convert import HF_DIR OUT_DIR takes only key=value after OUT_DIR."
        )
    report = import_hf(ns.hf_dir, ns.out_dir, overrides)
    for line in report:
        print(line)
    print(f"imported {len(report)} tensor names into {ns.out_dir}", file=sys.stderr)
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    mesh = sharding.make_mesh(MeshConfig())
    cfg, _, _, params, model_state, step, _ = restore(ns.source, mesh=mesh)  # newest readable
    run_dir = resolve(ns.source)[0]
    report = export_hf(params, cfg, ns.hf_dir, ns.family, model_state=model_state, run_dir=run_dir)
    for line in report:
        print(line)
    print(f"exported step {step} to {ns.hf_dir}", file=sys.stderr)
    return 0


def add_convert_parser(sub) -> None:
    c = sub.add_parser("convert", help="Hugging Face checkpoints in and out")
    csub = c.add_subparsers(dest="direction", required=True)
    i = csub.add_parser("import", help="a Hugging Face directory -> a run directory")
    i.add_argument("hf_dir", help="config.json + *.safetensors (+ tokenizer.json)")
    i.add_argument("out_dir", help="run directory to write (config.yaml, checkpoints/0)")
    i.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. model.dtype=float32")
    i.set_defaults(func=cmd_import)
    e = csub.add_parser("export", help="a run directory or checkpoint -> a Hugging Face directory")
    e.add_argument("source", help="run directory, its checkpoints directory, or one step")
    e.add_argument("hf_dir", help="directory to write config.json + model.safetensors into")
    e.add_argument("--family", choices=sorted(FAMILIES), help="default: chosen from the knobs")
    e.set_defaults(func=cmd_export)
