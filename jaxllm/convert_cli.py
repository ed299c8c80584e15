"""`jaxllm convert import|export`: Hugging Face checkpoints to run directories and back.

Both print one line per mapped tensor (Hugging Face name, layers, our parameters, shapes,
dtype) to stdout; a tensor that maps to nothing, a missing one, a shape mismatch, a broken file
(config.json, index, safetensors) or a knob the target family cannot express is a ConfigError
(one line, exit 2) before anything is written. The tokenizer and its special-token ids travel
both ways (tokenizer.json, tokenizer_config.json, special_tokens_map.json, the chat template,
generation_config.json).

A fine-tuning run (peft.method lora / qlora) exports with `--peft` (its adapters as Hugging
Face PEFT's adapter_config.json + adapter_model.safetensors, for `PeftModel.from_pretrained` on
the base) or `--merge` (one model, the adapters merged into the base); `import HF_DIR OUT_DIR
--peft ADAPTER_DIR` makes such a run of a PEFT adapter (`jaxllm.adapters.hf_peft`). A
bottleneck-adapter run (peft.method adapter) exports in neither form and is refused.

Both write their output directory whole or not at all: built in a hidden sibling and renamed
into place when complete (`jaxllm.config.outputs.written`). An output directory that holds
files, a file in its place, or one that is (or holds) what the command reads is refused before
anything is loaded; `--overwrite` replaces an occupied one, once the new one is complete.
"""

from __future__ import annotations

import argparse
import sys

from jaxllm import checkpoint, config, sharding, storage
from jaxllm.adapters import BASE_ITEM, export_peft, import_peft
from jaxllm.config import ConfigError, MeshConfig
from jaxllm.config.urls import check_url
from jaxllm.convert import FAMILIES, export_hf, import_hf, is_hf_dir
from jaxllm.convert.export import OUT_FLAG
from jaxllm.convert.gguf_export import TYPES, check_gguf, check_gguf_out, export_gguf
from jaxllm.convert.hf import check_out_dir
from jaxllm.load import fetched, resolve, restore
from jaxllm.model import lora

# What a reader of each output looks for, published last to a bucket (`storage.staged`): an
# imported run's checkpoint metadata, then its config.yaml; an export's index, then config.json.
RUN_MARKERS = ("_CHECKPOINT_METADATA", "config.yaml")
HF_MARKERS = ("model.safetensors.index.json", "config.json")
PEFT_MARKERS = ("adapter_config.json",)

CHECKPOINT_HELP = (
    "which checkpoint: last (the newest readable, the default), best (by evaluation, as "
    "checkpoint.keep_best keeps it) or a step number"
)


def cmd_import(ns: argparse.Namespace) -> int:
    overrides = [a for a in ns.overrides]
    if any("=" not in a for a in overrides):
        raise ConfigError(
            "jaxllm convert import HF_DIR OUT_DIR takes only key=value after OUT_DIR."
        )
    hf_dir = fetched(check_url(ns.hf_dir, "HF_DIR"), "HF_DIR")
    adapter = ns.peft and fetched(check_url(ns.peft, "--peft"), "--peft")
    if adapter and ns.dequantize:
        raise ConfigError("--dequantize imports a quantized model alone, not with --peft.")
    with storage.staged(ns.out_dir, "OUT_DIR", overwrite=ns.overwrite, last=RUN_MARKERS) as out:
        if adapter:
            report = import_peft(hf_dir, adapter, out, overrides, overwrite=ns.overwrite)
        else:
            report = import_hf(
                hf_dir, out, overrides, overwrite=ns.overwrite, dequantize=ns.dequantize
            )
    for line in report:
        print(line)
    print(f"imported {len(report)} tensor names into {ns.out_dir}", file=sys.stderr)
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    source = fetched(check_url(ns.source, "RUN_DIR"), "RUN_DIR")
    if ns.format == "gguf":
        return _export_gguf(ns, source)
    if ns.gguf_type:
        raise ConfigError("--gguf-type goes with --format gguf.")
    markers = PEFT_MARKERS if ns.peft else HF_MARKERS
    with storage.staged(ns.hf_dir, OUT_FLAG, overwrite=ns.overwrite, last=markers) as hf_dir:
        return _export(ns, source, hf_dir)


def _export(ns: argparse.Namespace, source: str, hf_dir) -> int:
    run_dir = resolve(source)[0]
    saved = config.load(run_dir / "config.yaml")
    method = saved.peft.method
    if method == "none" and (ns.peft or ns.merge):
        flag = "--peft" if ns.peft else "--merge"
        raise ConfigError(
            f"{ns.source} is not a fine-tuning run (peft.method=none), so it has no adapters "
            f"for {flag}; export it without {flag}."
        )
    if method != "none" and not (ns.peft or ns.merge):
        raise ConfigError(
            f"{ns.source} is a fine-tuning run (peft.method={method}) whose checkpoints hold "
            "only adapters; pass --peft for Hugging Face PEFT's adapter files or --merge for "
            "a checkpoint with the adapters merged into the base."
        )
    _no_bottleneck(ns, method)
    if method == "prompt":
        raise ConfigError(
            f"{ns.source} is a prompt-tuning run (peft.method=prompt): its soft prompt has "
            "no Hugging Face PEFT LoRA layout and no weights to merge into; it cannot be "
            "exported yet."
        )
    # Before the (long) restore: the output, and that it is not the run or its base.
    ckpts = checkpoint.checkpoint_dir(run_dir, saved.checkpoint.dir)
    reads = (run_dir, ckpts, saved.checkpoint.init_from)
    check_out_dir(hf_dir, flag=OUT_FLAG, overwrite=ns.overwrite, reads=reads)
    mesh = sharding.make_mesh(MeshConfig())
    # the newest readable, or the one --checkpoint names
    restored = restore(source, mesh=mesh, base=not ns.peft, which=ns.checkpoint)
    cfg, params, model_state = restored.cfg, restored.params, restored.model_state
    if ns.peft:
        ckpt_dir = checkpoint.checkpoint_dir(run_dir, cfg.checkpoint.dir)
        base = checkpoint.read_json_item(ckpt_dir, restored.step, BASE_ITEM)
        report = export_peft(params, cfg, hf_dir, ns.family, base, overwrite=ns.overwrite)
        source = (base or {}).get("source")
        if not (source and is_hf_dir(source)):
            print(
                "note: the run's base is not a Hugging Face directory, so adapter_config.json "
                "has base_model_name_or_path null; load the adapters onto the base exported "
                "with `jaxllm convert export`.",
                file=sys.stderr,
            )
    else:
        if ns.merge:
            params = lora.merged_params(restored.graphdef, params, restored.frozen, model_state)
        report = export_hf(
            params,
            cfg,
            hf_dir,
            ns.family,
            model_state=model_state,
            run_dir=run_dir,
            overwrite=ns.overwrite,
        )
    return _reported(report, restored.step, ns.hf_dir)


def _no_bottleneck(ns: argparse.Namespace, method: str) -> None:
    """ConfigError for a bottleneck-adapter run, which exports in no form: its adapters are
    nonlinear layers (no merged weights) of a kind Hugging Face PEFT does not have."""
    if method == "adapter":
        raise ConfigError(
            f"{ns.source} is a bottleneck-adapter run (peft.method=adapter): its adapters are "
            "nonlinear layers that merge into no weight (--merge), and Hugging Face PEFT has no "
            "bottleneck adapter type (--peft); it cannot be exported. Use it with jaxllm "
            "generate / eval / load_model, or train LoRA (peft.method=lora) to export."
        )


def _reported(report, step, out) -> int:
    """Prints an export's report lines, then what was exported where (stderr)."""
    for line in report:
        print(line)
    print(f"exported step {step} to {out}", file=sys.stderr)
    return 0


def _export_gguf(ns: argparse.Namespace, source: str) -> int:
    """`--format gguf`: one .gguf file for llama.cpp (`jaxllm.convert.gguf_export`)."""
    if ns.peft:
        raise ConfigError("--format gguf writes a whole model; --peft has no GGUF form.")
    run_dir = resolve(source)[0]
    saved = config.load(run_dir / "config.yaml")
    _no_bottleneck(ns, saved.peft.method)
    if saved.peft.method != "none" and not ns.merge:
        raise ConfigError(
            f"{ns.source} is a fine-tuning run (peft.method={saved.peft.method}); pass --merge "
            "to export it as one model."
        )
    check_gguf(saved, ns.family, ns.gguf_type)  # before the (long) restore
    check_gguf_out(ns.hf_dir, ns.overwrite)
    mesh = sharding.make_mesh(MeshConfig())
    restored = restore(source, mesh=mesh, which=ns.checkpoint)
    params = restored.params
    if ns.merge:
        params = lora.merged_params(
            restored.graphdef, params, restored.frozen, restored.model_state
        )
    report = export_gguf(
        params,
        restored.cfg,
        ns.hf_dir,
        ns.gguf_type,
        ns.family,
        model_state=restored.model_state,
        run_dir=run_dir,
        overwrite=ns.overwrite,
    )
    return _reported(report, restored.step, ns.hf_dir)


def add_convert_parser(sub) -> None:
    c = sub.add_parser("convert", help="Hugging Face checkpoints in and out")
    csub = c.add_subparsers(dest="direction", required=True)
    i = csub.add_parser("import", help="a Hugging Face directory -> a run directory")
    i.add_argument("hf_dir", help="config.json + *.safetensors (+ tokenizer.json)")
    i.add_argument("out_dir", help="run directory to write (config.yaml, checkpoints/0)")
    i.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. model.dtype=float32")
    i.add_argument(
        "--peft",
        metavar="ADAPTER_DIR",
        help="a Hugging Face PEFT LoRA adapter of HF_DIR (adapter_config.json + "
        "adapter_model.safetensors): OUT_DIR becomes a fine-tuning run of those adapters on "
        "the base HF_DIR",
    )
    i.add_argument(
        "--dequantize",
        action="store_true",
        help="a quantized checkpoint (compressed-tensors, GPTQ, AWQ) as a float run, its "
        "weights dequantized (default: a quantized run keeping the codes)",
    )
    i.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR when it already holds files (once the new run is complete)",
    )
    i.set_defaults(func=cmd_import)
    e = csub.add_parser("export", help="a run directory or checkpoint -> a Hugging Face directory")
    e.add_argument("source", help="run directory, its checkpoints directory, or one step")
    e.add_argument("hf_dir", help="directory to write config.json + model.safetensors into")
    e.add_argument("--family", choices=sorted(FAMILIES), help="default: chosen from the knobs")
    how = e.add_mutually_exclusive_group()
    how.add_argument(
        "--peft",
        action="store_true",
        help="a LoRA run's adapters as Hugging Face PEFT writes them (adapter_config.json + "
        "adapter_model.safetensors), for PeftModel.from_pretrained on the base",
    )
    how.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA / QLoRA run as one model: the adapters merged into the base weights",
    )
    e.add_argument(
        "--format",
        choices=("hf", "gguf"),
        default="hf",
        help="hf: a Hugging Face directory (the default); gguf: one .gguf file for llama.cpp "
        "(llama / mistral families), HF_DIR being its path",
    )
    e.add_argument(
        "--gguf-type",
        choices=TYPES,
        help="with --format gguf: the type of the 2-D weights (default f16; q8_0 / q4_0: "
        "GGUF's blocks of 32, quantized at export)",
    )
    e.add_argument("--checkpoint", default="last", help=CHECKPOINT_HELP)
    e.add_argument(
        "--overwrite",
        action="store_true",
        help="replace HF_DIR when it already holds files (once the new export is complete)",
    )
    e.set_defaults(func=cmd_export)
