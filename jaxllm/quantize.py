"""`jaxllm quantize SRC OUT --method M`: a trained model's weights quantized into a new run.

SRC is a run directory (or its checkpoints, or one step), a fine-tuning run (its adapters are
merged into the base first, NF4 dequantized) or a Hugging Face directory. OUT is a run directory
like `jaxllm convert import` writes: config.yaml (the source's, with `quantize.*` recording the
method and `run.dir` OUT), the tokenizer's files, and a weights-only checkpoint at step 0 whose
chosen weights are packed codes and scales (`jaxllm.model.quantized`). `generate`, `eval`,
`plan` and `load_model` read it like any run.

Every check runs before any work: the method, bits and group size (`quantize.*`), the group
size and packing against each chosen weight, a source that is already quantized, and OUT (which
may not hold files without --overwrite). OUT is built in a hidden sibling and renamed into
place when complete (`jaxllm.config.outputs.written`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import sys
from pathlib import Path

import jax

from jaxllm import compress, sharding, storage
from jaxllm import config as config_lib
from jaxllm.checkpoint import checkpoint_dir
from jaxllm.compress.calibrate import quantize_calibrated
from jaxllm.compress.weights import chosen
from jaxllm.config import Config, ConfigError, PeftConfig, QuantizeConfig
from jaxllm.config.quantize import CALIBRATED, DEFAULT_BITS, METHOD_BITS
from jaxllm.config.train import QATConfig
from jaxllm.convert import load_params
from jaxllm.convert.hf import NewRun, check_out_dir, new_run, refuse_inside
from jaxllm.convert.reader import TOKENIZER_FILES, read_hf_config
from jaxllm.data.tokenizer import GENERATION_CONFIG
from jaxllm.load import (
    _is_hf_source,
    _mergeable,
    _shapes,
    fetched,
    merged_weights,
    resolve,
    restore,
    weight_targets,
)
from jaxllm.model import abstract_model

__all__ = [
    "calibration_options",
    "options",
    "quantize_run",
]

OUT_FLAG = "OUT"
# the quantize.* keys the command's options set, in the order of `options`' arguments
OPTION_KEYS = {
    "quantize.method": "--method",
    "quantize.bits": "--bits",
    "quantize.group_size": "--group-size",
    "quantize.symmetric": "--symmetric / --asymmetric",
    "quantize.calibration": "--calibration",
    "quantize.samples": "--samples",
}


def options(
    method: str,
    bits: int | None,
    group_size: int | None,
    symmetric: bool | None,
    calibration: str | None = None,
    samples: int | None = None,
):
    """The `quantize.*` overrides of the command's options (`--method`, `--bits`, ...; a
    method's default bits); a ConfigError names the parameter and its option."""
    if method not in METHOD_BITS:
        raise ConfigError(
            f"method (--method) {method} is not a quantization method jaxllm has; it has "
            f"{', '.join(METHOD_BITS)}."
        )
    out = [f"quantize.method={method}"]
    if bits is None:
        bits = DEFAULT_BITS.get(method)
    if bits is not None:
        out.append(f"quantize.bits={bits}")
    if group_size is not None:
        out.append(f"quantize.group_size={group_size}")
    if symmetric is not None:
        out.append(f"quantize.symmetric={str(symmetric).lower()}")
    return out + calibration_options("quantize", method, CALIBRATED, calibration, samples)


def calibration_options(section: str, method: str, calibrated, calibration, samples) -> list:
    """The `SECTION.calibration` / `SECTION.samples` overrides of `calibration` / `samples`
    (--calibration / --samples); ConfigError when `method` is not among the `calibrated` ones."""
    if (calibration is not None or samples is not None) and method not in calibrated:
        raise ConfigError(
            f"method (--method) {method} reads no calibration data (calibration, samples: "
            f"--calibration, --samples); the calibrated methods are {', '.join(calibrated)}."
        )
    out = [] if calibration is None else [f"{section}.calibration={json.dumps(calibration)}"]
    return out + ([] if samples is None else [f"{section}.samples={samples}"])


def quantize_run(src, out, overrides=(), *, overwrite: bool = False) -> Path:
    """Writes the quantized run OUT from SRC; `overrides` are `key=value`s, the `quantize.*` of
    the command's options among them. Returns OUT."""
    if storage.is_url(str(out)):
        raise ConfigError(
            f"OUT {out}: jaxllm quantize writes a local directory; write it there and copy it "
            "to the bucket."
        )
    if any(arg.split("=", 1)[0].strip() == "run.dir" for arg in overrides):
        raise ConfigError("run.dir: OUT names the quantized run's directory; leave run.dir unset.")
    src = Path(fetched(src, "SRC"))
    if not src.exists():
        raise ConfigError(f"SRC {src} does not exist; give a run or a Hugging Face directory.")
    if _is_hf_source(src):
        _check_hf_float(src)
        check_out_dir(out, flag=OUT_FLAG, overwrite=overwrite, reads=(src,))  # named as OUT
        _check_out(out, overwrite, (src,))
        new = new_run(src, out, overrides, overwrite=overwrite)
        _check_out(new.ckpt_dir, overwrite, (src,), flag="checkpoint.dir")
        cfg = new.cfg.validate()
        _check_method(cfg)
        mesh = sharding.make_mesh(cfg.mesh)
        _check_weights(cfg)
        params, model_state, _ = load_params(src, cfg.model, mesh)
    else:
        out = check_out_dir(out, flag=OUT_FLAG, overwrite=overwrite, reads=(src,))
        run_dir, _, _ = resolve(src)
        saved = config_lib.load(run_dir / "config.yaml")
        reads = (run_dir, checkpoint_dir(run_dir, saved.checkpoint.dir))
        _check_out(out, overwrite, reads)
        if saved.quantize.enabled and saved.peft.method == "none":  # not a LoRA run on it
            raise ConfigError(
                f"{src} is already quantized (quantize.method={saved.quantize.method}, "
                f"{saved.quantize.bits} bits); quantize the run it was made from."
            )
        cfg = _out_config(saved, out, overrides)
        _check_model(saved, cfg)
        ckpt_dir = checkpoint_dir(out, cfg.checkpoint.dir)  # OUT/checkpoints, or checkpoint.dir
        if not ckpt_dir.resolve().is_relative_to(out.resolve()):
            check_out_dir(ckpt_dir, flag="checkpoint.dir", overwrite=overwrite, reads=reads)
            _check_out(ckpt_dir, overwrite, reads, flag="checkpoint.dir")
        _check_method(cfg)
        devices = jax.devices()
        cfg.validate(len(devices))
        _check_weights(cfg)
        mesh = sharding.make_mesh(cfg.mesh, devices)
        params, model_state = _source_weights(src, saved, cfg, mesh)
        new = NewRun(out, cfg, ckpt_dir, _tokenizer_files(saved), overwrite)
        new = _with_tokenizer(new)
    _, _, axes = abstract_model(cfg.model)
    if cfg.quantize.calibrated:
        q = quantize_calibrated(params, model_state, axes, cfg, mesh)
    else:
        q = compress.quantize_params(params, axes, cfg.quantize, mesh)
    new.write(q, model_state)
    return Path(out)


def _check_out(out, overwrite: bool, reads, flag: str = OUT_FLAG) -> None:
    """ConfigError when OUT (or the `flag` directory) lies inside a directory the command reads
    (the source run, its checkpoints), or when --overwrite would replace an OUT that is not a
    run."""
    out = Path(out)
    refuse_inside(out, reads, flag, "quantized run")
    if flag != OUT_FLAG or not overwrite or (out / "config.yaml").is_file():
        return
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(
            f"OUT {out} holds files but is not a run (no config.yaml); --overwrite replaces "
            "only a run: choose a new directory."
        )


def _check_model(saved: Config, cfg: Config) -> None:
    """ConfigError when `model.*` overrides give the quantized run other parameter shapes
    than the source's weights."""
    have, want = (_shapes(abstract_model(c.model)[1]) for c in (saved, cfg))
    if want != have:
        path = sorted(set(want.items()) ^ set(have.items()))[0][0]
        raise ConfigError(
            f"the model.* overrides change the model's parameters (first: {path}: "
            f"{have.get(path)} in SRC, {want.get(path)} with them); a quantized run keeps the "
            "source's model: leave its shapes unchanged."
        )


def _check_hf_float(src: Path) -> None:
    """ConfigError when the Hugging Face directory `src` holds quantized weights."""
    qc = read_hf_config(src).get("quantization_config")
    if qc:
        how = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise ConfigError(
            f"{src} is already quantized (its config.json's quantization_config, quant_method "
            f"{how}); quantize the float model it was made from."
        )


def _check_method(cfg: Config) -> None:
    if not cfg.quantize.enabled:
        raise ConfigError("quantize.method=none quantizes nothing; name a method (--method rtn).")


def _check_weights(cfg: Config) -> None:
    """ConfigError, before any weight is read, when the groups or packing do not fit."""
    _, abstract, axes = abstract_model(cfg.model)
    compress.quantized_abstract(abstract, axes, cfg.quantize)
    taken = chosen(abstract, axes, dataclasses.replace(cfg.quantize, skip=()))
    if cfg.quantize.head and not any(p.endswith("lm_head") for p in taken):
        raise ConfigError(
            "quantize.head=true: this model has no LM head of its own to quantize (a head tied "
            "to the embedding, model.tie_embeddings, stays in its dtype with it)."
        )
    for pattern in cfg.quantize.skip:
        if not any(fnmatch.fnmatchcase(path, pattern) for path in taken):
            raise ConfigError(
                f"quantize.skip: {pattern!r} matches none of the weights --method "
                f"{cfg.quantize.method} takes ({', '.join(list(taken)[:3])}, ...)."
            )


def _out_config(saved: Config, out: Path, overrides) -> Config:
    """The quantized run's config: the source's (merged into a plain model when it fine-tuned
    adapters; `train.qat` off, its weights now what QAT rounded them to), its directories OUT's
    own, with `overrides` applied."""
    tree = config_lib.to_dict(
        dataclasses.replace(
            saved,
            peft=PeftConfig(),
            quantize=QuantizeConfig(),  # a LoRA run's quantized base is merged into floats
            run=dataclasses.replace(saved.run, dir=str(out)),
            checkpoint=dataclasses.replace(saved.checkpoint, dir=None, init_from=None),
            train=dataclasses.replace(saved.train, qat=QATConfig()),  # a QAT run's training
        )
    )
    tree = config_lib.apply_overrides(tree, list(overrides))
    return config_lib.from_dict(tree)


def _source_weights(src: Path, saved: Config, cfg: Config, mesh):
    """(params, model state) of the source on `mesh`: a fine-tuning run's merged model."""
    if saved.peft.method == "none":
        restored = restore(src, mesh=mesh)
        return restored.params, restored.model_state
    _mergeable(src, saved)
    restored = restore(src, mesh=mesh)
    _, target, _ = weight_targets(cfg.model, mesh)
    return merged_weights(restored, target), restored.model_state


def _tokenizer_files(saved: Config) -> tuple[Path, ...]:
    """The source's tokenizer.json and the files beside it that belong to it, to copy (a
    SentencePiece model stays where the source's config names it)."""
    tok = Path(saved.data.tokenizer)
    if not tok.is_file() or tok.name != "tokenizer.json":
        return ()
    extra = (tok.parent / n for n in (*TOKENIZER_FILES, GENERATION_CONFIG))
    return (tok, *(p for p in extra if p.is_file()))


def _with_tokenizer(new: NewRun) -> NewRun:
    """`new` whose config names the tokenizer copied into OUT (`NewRun.write` copies it)."""
    if not new.copies:
        return new
    name = (new.out_dir / new.copies[0].name).resolve()
    data = dataclasses.replace(new.cfg.data, tokenizer=str(name))
    return dataclasses.replace(new, cfg=dataclasses.replace(new.cfg, data=data))


def cmd_quantize(ns) -> int:
    src, out, *rest = ns.args if len(ns.args) >= 2 else (None, None)
    stray = [a for a in rest if "=" not in a]
    if src is None or out is None or stray:
        raise ConfigError("jaxllm quantize takes SRC OUT, then only key=value.")
    values = (ns.method, ns.bits, ns.group_size, ns.symmetric, ns.calibration, ns.samples)
    keys = {arg.split("=", 1)[0].strip() for arg in rest}
    for (key, flag), value in zip(OPTION_KEYS.items(), values):
        if key in keys and value is not None:
            raise ConfigError(f"{key}= and {flag} both set {key}; pass one of them.")
    how = options(*values)
    if "quantize.bits" in keys:  # the key's bits, not the method's default
        how = [h for h in how if not h.startswith("quantize.bits=")]
    quantize_run(src, out, [*rest, *how], overwrite=ns.overwrite)
    print(f"quantized {src} into {out}", file=sys.stderr)
    return 0


def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="quantize a trained model's weights into a new run")
    q.add_argument("args", nargs="+", metavar="SRC OUT key=value")
    q.add_argument(
        "--method",
        required=True,
        help="rtn | gptq | awq | smoothquant | llm_int8 | fp8 | mxfp4 (docs/compression.md)",
    )
    q.add_argument(
        "--bits",
        type=int,
        help="bits per weight: rtn / gptq / awq 8, 4, 3, 2 (default 8, 4, 4); mxfp4 4; others 8",
    )
    q.add_argument(
        "--group-size", type=int, help="input channels per scale; 0 (default): per channel"
    )
    q.add_argument(
        "--calibration",
        help="gptq / awq / smoothquant: a data source (a path, or a mapping like {path: x.jsonl, format: "
        "chat}); default: the run's held-out split",
    )
    q.add_argument("--samples", type=int, help="calibration rows of data.seq_len (default 128)")
    sym = q.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", default=None)
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false")
    q.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    q.set_defaults(func=cmd_quantize)
