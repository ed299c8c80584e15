"""A Hugging Face model directory as it is on disk: config.json, the safetensors index, and the
safetensors files' headers and tensors (`Reader`), read without trusting them blindly: a broken
or inconsistent file is a one-line ConfigError naming it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxllm.config import ConfigError
from jaxllm.convert import autoquant, coded_formats, mxfp4
from jaxllm.convert.families import first_line
from jaxllm.convert.packed import SUFFIXES, dequantized, module_codes, run_quantize

DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
INDEX = "model.safetensors.index.json"
# Files beside tokenizer.json that import copies into the run directory with it (its specials,
# chat template) and export writes back; generation_config.json travels with them too.
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# A vision-language model's processor (image sizes, normalisation) and its chat template:
# they travel with the model (import keeps them in the run, export writes them back).
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)
PREPROCESSOR = "preprocessor_config.json"


def pixel_budget(preprocessor: dict) -> dict:
    """`model.vision.min_pixels` / `max_pixels` of an image processor's config (its
    `min_pixels` / `max_pixels`, or transformers 5's `size.shortest_edge` / `longest_edge`)."""
    size = preprocessor.get("size") or {}
    out = {
        "min_pixels": preprocessor.get("min_pixels", size.get("shortest_edge")),
        "max_pixels": preprocessor.get("max_pixels", size.get("longest_edge")),
    }
    return {k: int(v) for k, v in out.items() if isinstance(v, (int, float))}


def with_pixel_budget(preprocessor: dict, min_pixels: int, max_pixels: int) -> dict:
    """`preprocessor` with the run's pixel budget in the keys it has (`pixel_budget`)."""
    out = {**preprocessor}
    for key, edge, value in (
        ("min_pixels", "shortest_edge", min_pixels),
        ("max_pixels", "longest_edge", max_pixels),
    ):
        if key in out:
            out[key] = value
        if edge in (out.get("size") or {}):
            out["size"] = {**out["size"], edge: value}
    return out


def is_hf_dir(path) -> bool:
    """Whether `path` is a Hugging Face model directory: config.json and safetensors."""
    path = Path(path)
    has_weights = (path / INDEX).is_file() or any(path.glob("*.safetensors"))
    return (path / "config.json").is_file() and has_weights


def read_json(path: Path):
    """The JSON value of `path`; ConfigError (one line, with the position) when it is not JSON."""
    try:
        return json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); fix it "
            "or download it again."
        ) from None
    except (ValueError, OSError) as e:  # not UTF-8 text, unreadable
        raise ConfigError(f"cannot read {path} ({first_line(e)}); download it again.") from None


def read_hf_config(hf_dir) -> dict:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        state = "is a file, not a directory" if hf_dir.exists() else "does not exist"
        raise ConfigError(
            f"{hf_dir} {state}; give a Hugging Face model directory (config.json + *.safetensors)."
        )
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{hf_dir} has no config.json; give a Hugging Face model directory.")
    hf = read_json(path)
    if not isinstance(hf, dict):
        raise ConfigError(
            f"{path} holds a JSON {type(hf).__name__}, not an object; give the model's own "
            "config.json."
        )
    return hf


def safetensors_files(hf_dir) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files transformers reads, and the index's tensor -> file map if any.

    With `model.safetensors.index.json`, exactly the files its weight_map names: Mistral's Hub
    repos ship `consolidated.safetensors` (Mistral's own tensor names) beside the sharded
    Hugging Face files, and reading both would see every weight twice under two names. Without
    one, `model.safetensors` when present (transformers reads nothing else), else every
    `*.safetensors` (a hand-made directory)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX
    if index.is_file():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not (
            isinstance(weight_map, dict)
            and weight_map
            and all(isinstance(v, str) and Path(v).name == v for v in weight_map.values())
        ):
            raise ConfigError(
                f"{index} has no weight_map of tensor names to file names; fix it or download "
                "it again."
            )
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (hf_dir / n).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ConfigError(
                f"{index} names {missing[0]}{more}, which is not in {hf_dir}; download every "
                "file the index lists."
            )
        return [hf_dir / n for n in names], weight_map
    if (hf_dir / "model.safetensors").is_file():
        return [hf_dir / "model.safetensors"], None
    return sorted(hf_dir.glob("*.safetensors")), None


class Reader:
    """Names, shapes and dtypes of every tensor in a directory's safetensors files (headers
    only); `read` loads one tensor, or one slice of it.

    The files are not trusted blindly: an unreadable file (truncated, not safetensors) and a
    tensor stored in two files (which one would win?) are ConfigErrors naming the files."""

    def __init__(self, hf_dir):
        hf_dir = Path(hf_dir)
        self.files, weight_map = safetensors_files(hf_dir)
        if not self.files:
            raise ConfigError(
                f"{hf_dir} holds no .safetensors files; give a Hugging Face model directory "
                "with its weights."
            )
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for f in self.files:
            for name, shape, dtype in _header(f):
                if name in self.where:
                    raise ConfigError(
                        f"tensor {name} is in both {self.where[name].name} and {f.name} in "
                        f"{hf_dir}; remove the stale file (or add the {INDEX} that names the "
                        "files to read)."
                    )
                self.where[name], self.shapes[name], self.dtypes[name] = f, shape, dtype
        # tensors numpy has no dtype for (E4M3 weights): `read` gives their bytes, uint8
        self.bytes_only = {n for n, dt in self.dtypes.items() if dt == "F8_E4M3"}
        for name, file in (weight_map or {}).items():
            if self.where.get(name) != hf_dir / file:
                raise ConfigError(
                    f"{hf_dir / INDEX} puts tensor {name} in {file}, which does not hold it; "
                    "download the files again."
                )

        self._compressed(hf_dir)

    def _compressed(self, hf_dir: Path) -> None:
        """compressed-tensors' packed modules (`M.weight_packed`, ...) seen as their float
        `M.weight`, which `read` dequantizes (`jaxllm.convert.compressed`); its fp8, int8 and
        MXFP4 modules in `_coded`."""

        self.modules: dict[str, str] = {}
        self.bits = 0
        self.auto: dict | None = None  # a GPTQ / AWQ quantization_config
        self.coded: str | None = None  # the kind of compressed-tensors' fp8 / int8 / MXFP4 codes
        self.mx = False  # gpt-oss's MXFP4 experts (`_mxfp4`)
        packed = [n.removesuffix(".weight_packed") for n in self.shapes if n.endswith("_packed")]
        auto = [n.removesuffix(".qweight") for n in self.shapes if n.endswith(".qweight")]
        # config.json, read once (a PEFT adapter directory has none, and nothing packed)
        has_config = (hf_dir / "config.json").is_file()
        hf = read_hf_config(hf_dir) if has_config or auto or packed else {}
        method = (hf.get("quantization_config") or {}).get("quant_method")
        if method == mxfp4.METHOD:
            self._mxfp4(hf_dir)
            return
        if auto:
            self._auto(hf_dir, hf, auto)
        if method in autoquant.METHODS and not auto and not packed:
            raise ConfigError(
                f"{hf_dir} is a quantized checkpoint (quantization_config: quant_method "
                f"{method}) whose files hold no packed weights (M.qweight); give the quantized "
                "files, or remove quantization_config from config.json."
            )
        if coded_formats.is_coded(hf.get("quantization_config")):
            self._coded(hf_dir, hf["quantization_config"])
            return
        if not packed:
            return
        if method in autoquant.METHODS:
            raise ConfigError(
                f"{hf_dir} holds compressed-tensors packed weights ({packed[0]}.weight_packed) "
                f"but config.json's quantization_config says quant_method {method}; fix "
                "config.json."
            )
        self.bits = run_quantize(hf, hf_dir).get("bits", 0)
        if not self.bits:
            raise ConfigError(
                f"{hf_dir} holds compressed-tensors packed weights ({packed[0]}.weight_packed) "
                "but config.json has no compressed-tensors quantization_config."
            )
        for m in packed:
            name = f"{m}.weight"
            self.modules[name] = m
            self.shapes[name] = tuple(int(x) for x in self._read(f"{m}.weight_shape"))
            self.dtypes[name] = self.dtypes[f"{m}.weight_scale"]
            for suffix in SUFFIXES:
                self.shapes.pop(f"{m}.{suffix}", None)
                self.dtypes.pop(f"{m}.{suffix}", None)

    def _mxfp4(self, hf_dir: Path) -> None:
        """gpt-oss's MXFP4 experts (`NAME_blocks` + `NAME_scales`) seen as their float `NAME`
        (`jaxllm.convert.mxfp4`), stored as the checkpoint's other float tensors are."""
        found = mxfp4.packed_tensors(self.shapes)
        if not found:
            raise ConfigError(
                f"{hf_dir}'s config.json says quant_method mxfp4 but its files hold no MXFP4 "
                "tensors (NAME_blocks with NAME_scales); give the quantized files."
            )
        for base in found:
            for suffix in mxfp4.SUFFIXES:
                self.shapes.pop(base + suffix)
                self.dtypes.pop(base + suffix)
        stored = {v: k for k, v in DTYPES.items()}[self.param_dtype()]
        for base, shape in found.items():
            self.modules[base] = base
            self.shapes[base], self.dtypes[base] = shape, stored
        self.mx = True

    def _coded(self, hf_dir: Path, qc: dict) -> None:
        """compressed-tensors' fp8 / int8 / MXFP4 modules (every `M.weight_scale`) seen as
        their float `M.weight` (`jaxllm.convert.coded_formats`), stored as the checkpoint's
        other float tensors are; `qc`: config.json's quantization_config."""
        kind = self.coded = coded_formats.weight_kind(qc, hf_dir)
        scales = [n for n in self.shapes if n.endswith(".weight_scale")]
        modules = [n.removesuffix(".weight_scale") for n in scales]
        if not modules:
            raise ConfigError(
                f"{hf_dir}'s config.json has a compressed-tensors {kind} quantization_config "
                "but its files hold no quantized modules (M.weight_scale); give the quantized "
                "files, or remove quantization_config from config.json."
            )
        found = {
            m: coded_formats.weight_shape(kind, self.shapes, self.dtypes, m, hf_dir)
            for m in modules
        }
        for m in modules:
            for name in (f"{m}.weight", *(f"{m}.{suffix}" for suffix in coded_formats.SUFFIXES)):
                self.shapes.pop(name, None)
                self.dtypes.pop(name, None)
        stored = {v: k for k, v in DTYPES.items()}[self.param_dtype()]
        for m, shape in found.items():
            self.modules[f"{m}.weight"] = m
            self.shapes[f"{m}.weight"], self.dtypes[f"{m}.weight"] = shape, stored

    def _auto(self, hf_dir: Path, hf: dict, modules: list[str]) -> None:
        """GPTQ / AWQ packed modules (`M.qweight`, ...) seen as their float `M.weight`
        (`jaxllm.convert.autoquant`); `hf`: config.json."""
        qc = hf.get("quantization_config") or {}
        if qc.get("quant_method") not in autoquant.METHODS:
            raise ConfigError(
                f"{hf_dir} holds GPTQ / AWQ packed weights ({modules[0]}.qweight) but "
                "config.json has no gptq or awq quantization_config."
            )
        self.auto = qc
        self.bits = run_quantize(hf, hf_dir)["bits"]
        for m in modules:
            name = f"{m}.weight"
            self.modules[name] = m
            self.shapes[name] = autoquant.shape(self._read, m, qc)
            self.dtypes[name] = self.dtypes[f"{m}.scales"]
            for suffix in autoquant.SUFFIXES:
                self.shapes.pop(f"{m}.{suffix}", None)
                self.dtypes.pop(f"{m}.{suffix}", None)

    def codes(self, name: str, dtype) -> tuple[np.ndarray, ...]:
        """(codes [out, in], scales [out, groups], zero points or None) of the packed module
        whose float weight is `name`."""
        if self.auto is not None:
            return autoquant.module_codes(self._read, self.modules[name], self.auto, dtype)
        if self.coded is not None:  # (codes, scales [out, groups] as jaxllm holds them, None)
            return (*coded_formats.module_codes(self._read, self.modules[name], self.coded), None)
        return module_codes(self._read, self.modules[name], self.bits, dtype)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        if name in self.modules:
            if self.mx:
                w = mxfp4.dequantize(self._read(name + "_blocks"), self._read(name + "_scales"))
            elif self.auto is not None:
                w = autoquant.dequantized(self._read, self.modules[name], self.auto, np.float32)
            elif self.coded is not None:
                w = coded_formats.dequantized(
                    self._read, self.modules[name], self.coded, np.float32
                )
            else:
                w = dequantized(self._read, self.modules[name], self.bits, np.float32)
            return w if index is None else w[index]
        return self._read(name, index)

    def _read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        if name not in self.where:
            raise KeyError(name)
        if name in self.bytes_only:
            raw = tensor_bytes(self.where[name], name)
            return raw if index is None else raw[index]
        try:
            with safe_open(self.where[name], framework="numpy") as h:
                if index is None:
                    return h.get_tensor(name)
                return h.get_slice(name)[index]
        except SafetensorError as e:
            raise ConfigError(
                f"cannot read tensor {name} from {self.where[name]} ({first_line(e)}); "
                "download the file again."
            ) from None

    def param_dtype(self) -> str:
        """The checkpoint's storage dtype: the most common float dtype, by bytes (integer
        tensors where floats belong are refused by `check`, by name)."""
        count: dict[str, int] = {}
        for name, dt in self.dtypes.items():
            count[dt] = count.get(dt, 0) + math.prod(self.shapes[name])
        floats = {dt: n for dt, n in count.items() if dt in DTYPES}
        if not floats:
            raise ConfigError(
                f"{self.files[0].parent} holds no float tensors (dtypes {', '.join(sorted(count))}"
                "); jaxllm imports F32, BF16 and F16 weights: dequantize them first."
            )
        return DTYPES[max(floats, key=floats.get)]

    def equal(self, a: str, b: str, rows: int = 4096) -> bool:
        """Whether tensors `a` and `b` hold the same values (compared `rows` rows at a time, so
        two vocabulary-sized matrices are never in memory whole)."""
        if self.shapes[a] != self.shapes[b] or self.dtypes[a] != self.dtypes[b]:
            return False
        if not self.shapes[a]:
            return bool(np.array_equal(self.read(a), self.read(b)))
        n = self.shapes[a][0]
        return all(
            np.array_equal(
                self.read(a, (slice(i, min(i + rows, n)),)),
                self.read(b, (slice(i, min(i + rows, n)),)),
            )
            for i in range(0, n, rows)
        )


def tensor_bytes(path: Path, name: str) -> np.ndarray:
    """Tensor `name` of the safetensors file `path` as its bytes (uint8, the tensor's shape;
    one-byte dtypes only), read by the file's header offsets."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(n))[name]
            begin, end = meta["data_offsets"]
            f.seek(8 + n + begin)
            data = f.read(end - begin)
        return np.frombuffer(data, np.uint8).reshape(meta["shape"])
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            f"cannot read tensor {name} from {path} ({first_line(e)}); download the file again."
        ) from None


def _header(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every tensor of one safetensors file."""
    try:
        with safe_open(path, framework="numpy") as h:
            out = []
            for name in h.keys():
                s = h.get_slice(name)
                out.append((name, tuple(s.get_shape()), s.get_dtype()))
            return out
    except (SafetensorError, OSError) as e:
        raise ConfigError(
            f"{path} is not a readable safetensors file ({first_line(e)}); download it again."
        ) from None
