"""Loading: YAML (1.2 scalars) with includes, presets (`model=NAME`), `key.sub=value`
overrides, type checking of every value against the dataclass fields, and writing back."""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxllm.config.errors import ConfigError
from jaxllm.config.errors import fail as _fail
from jaxllm.config.root import Config


class DuplicateKey(yaml.YAMLError):
    """A mapping that gives a key twice (PyYAML would keep the last one without a word)."""

    def __init__(self, key: str, lines: tuple[int, int]):
        super().__init__(f"{key} is given twice (lines {lines[0]} and {lines[1]})")
        self.key, self.lines = key, lines


def _check_unique(node: yaml.Node, path: str, seen: set[int]) -> None:
    """Raises DuplicateKey for the first key given twice in a mapping under `node`; `path`
    names `node` in the message (`train`, `data.sources[0]`). Merge keys (`<<: *base`) may be
    overridden on purpose and are left alone."""
    if id(node) in seen:  # an alias of a node already checked (or a recursive one)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            name = f"{path}.{key.value}" if path else key.value
            line = key.start_mark.line + 1
            if (key.tag, key.value) in first:
                raise DuplicateKey(name, (first[key.tag, key.value], line))
            first[key.tag, key.value] = line
            _check_unique(value, name, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique(item, f"{path}[{i}]", seen)


class _Loader(yaml.SafeLoader):
    """YAML 1.2 scalars: only true/false are booleans (`yes`, `on` stay strings) and `1e-3` is
    a float (YAML 1.1 wants a dot); and a key given twice in one mapping is a DuplicateKey. (The
    check walks the whole document before it is built, since a mapping alone does not know its
    path, which the message names.)"""

    def construct_document(self, node):
        _check_unique(node, "", set())
        return super().construct_document(node)


_Loader.yaml_implicit_resolvers = {
    k: [
        (tag, rx)
        for tag, rx in v
        if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float")
    ]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$"
        r"|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


def _yaml(text: str | bytes):
    return yaml.load(text, Loader=_Loader)


def _what(value: Any) -> str:
    """A YAML value as a message names it: `a list`, `the number 3`, `the string 'x'`."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value if len(value) <= 40 else value[:37] + '...'!r}"
    return "a list" if isinstance(value, list) else f"a {type(value).__name__}"


# ----------------------------------------------------------------------------------------------

SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_PRESET_DIRS = {"model": "models", "mesh": "mesh"}


def configs_dir() -> Path:
    """The `configs/` directory: $JAXLLM_CONFIGS, else ./configs, else the one beside the package."""
    if env := os.environ.get("JAXLLM_CONFIGS"):
        return Path(env)
    cwd = Path.cwd() / "configs"
    return cwd if cwd.is_dir() else Path(__file__).resolve().parents[2] / "configs"


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        _fail(f"{path} includes itself (through {' -> '.join(p.name for p in seen)}).")
    if not path.is_file():
        _fail(f"config file {path} does not exist; check the path.")
    try:
        raw = _yaml(path.read_bytes())  # bytes: YAML's own encodings (UTF-8, -16), not the locale's
    except yaml.reader.ReaderError as e:  # bytes that are not UTF-8, or control characters
        at = (
            f"byte {e.position} is not {e.encoding.upper()}"
            if e.encoding != "unicode"  # a decoding error, not a character YAML refuses
            else f"character {e.position} is U+{e.character:04X}, which YAML does not allow"
        )
        _fail(f"{path} is not a text YAML file ({at}); give a YAML config.")
    except DuplicateKey as e:
        _fail(f"{path}: {e}; keep one of them.")
    except yaml.YAMLError as e:
        _fail(f"{path} is not valid YAML: {str(e).splitlines()[0]}.")
    if raw is None:
        _fail(f"{path} is empty; give it sections (train:, model:, ...) or no CONFIG at all.")
    if not isinstance(raw, dict):
        _fail(f"{path} must hold a mapping of sections (train:, model:, ...), not {_what(raw)}.")
    for section, value in raw.items():
        if section == "include" or value is None or isinstance(value, dict):
            continue
        if not (isinstance(value, str) and section in _PRESET_DIRS):
            what = "a mapping of keys" + (" or a preset name" if section in _PRESET_DIRS else "")
            _fail(f"{path}: section `{section}:` must be {what}, not {_what(value)}.")
    includes = raw.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict = {}
    for inc in includes:
        _deep_merge(merged, _read_yaml(path.parent / inc, seen + (path,)))
    for section, value in raw.items():
        _deep_merge(merged, {section: _expand_preset(section, value, path.parent, seen + (path,))})
    return merged


def _expand_preset(section: str, value: Any, base: Path, seen: tuple[Path, ...]) -> Any:
    """`model: tiny` -> the `model` section of configs/models/tiny.yaml."""
    if not isinstance(value, str) or section not in _PRESET_DIRS:
        return value
    candidates = [
        Path(value),
        base / value,
        configs_dir() / _PRESET_DIRS[section] / f"{value}.yaml",
    ]
    path = next((p for p in candidates if p.suffix in (".yaml", ".yml") and p.is_file()), None)
    if path is None:
        available = sorted(p.stem for p in (configs_dir() / _PRESET_DIRS[section]).glob("*.yaml"))
        _fail(
            f"{section}={value!r} names no preset; available in configs/{_PRESET_DIRS[section]}/: "
            f"{', '.join(available) or 'none'}."
        )
    data = _read_yaml(path, seen)
    if set(data) - {section}:
        _fail(f"preset {path} may only hold the `{section}:` section.")
    return data.get(section, {})


def _deep_merge(into: dict, other: dict) -> dict:
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = v
    return into


def _parse_override(item: str) -> dict:
    if "=" not in item:
        _fail(f"override {item!r} must look like key.sub=value (for example train.steps=20).")
    key, _, text = item.partition("=")
    key = key.strip()
    try:
        value = _yaml(text) if text.strip() else None
    except DuplicateKey as e:
        where = e.key if e.key.startswith("[") else f".{e.key}"
        _fail(f"override {item!r}: {key}{where} is given twice; keep one of them.")
    except yaml.YAMLError:
        value = text
    if key in _PRESET_DIRS and isinstance(value, str):
        return {key: _expand_preset(key, value, Path.cwd(), ())}
    if key in SECTIONS and not isinstance(value, dict):
        names = f"a preset name (configs/{_PRESET_DIRS[key]}/) or " if key in _PRESET_DIRS else ""
        _fail(
            f"override {item!r}: `{key}` is a section; give {names}a key in it, e.g. {key}.KEY=VALUE."
        )
    node: Any = value
    for part in reversed(key.split(".")):
        if not part:
            _fail(f"override {item!r} has an empty key part.")
        node = {part: node}
    return node


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Checks `value` against the annotation `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            _fail(f"{key} must be a list, not {value!r}.")
        if dataclasses.is_dataclass(item_tp):
            return tuple(_build(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value))
        return tuple(_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if dataclasses.is_dataclass(tp):  # an optional subsection (`model.vision`)
        return _build(tp, value, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            _fail(f"{key} must be one of {', '.join(map(str, choices))}, not {value!r}.")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            _fail(f"{key} must be true or false, not {value!r}.")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(f"{key} must be an integer, not {value!r}.")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(f"{key} must be a number, not {value!r}.")
        return float(value)
    if tp is str:
        if value is None:  # `key=` (a shell eats key="") or `key:` in YAML: null
            _fail(f"{key} must be a string, not empty (null); for the empty string, quote "
                  f"the quotes: \"{key}=''\".")  # fmt: skip
        if not isinstance(value, str):
            _fail(f"{key} must be a string, not {value!r}; quote it.")
        return value
    raise TypeError(f"unsupported annotation {tp} for {key}")  # a bug in this file, not the user's


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        _fail(f"{prefix} must be a mapping of keys, not {data!r}.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    moved = [k for k in unknown if k in getattr(cls, "moved_keys", {})]
    if moved:
        _fail(f"{prefix}.{moved[0]} is now {prefix}.{cls.moved_keys[moved[0]]}; rename the key.")
    if unknown:
        import difflib

        key, _, value = str(unknown[0]).partition(":")
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f"did you mean {prefix}.{close[0]}?" if close else f"known keys: {', '.join(names)}."
        if key in names and value:  # YAML reads `{path:x}` as one key: its colon needs a space
            hint = f"YAML needs a space after the colon: write {{{key}: {value}}}."
        _fail(f"unknown config key {prefix}.{unknown[0]}; {hint}")
    kwargs = {}
    for k, v in data.items():
        if dataclasses.is_dataclass(hints[k]):
            kwargs[k] = _build(hints[k], v, f"{prefix}.{k}")
        else:
            kwargs[k] = _coerce(f"{prefix}.{k}", v, hints[k])
    return cls(**kwargs)


def from_dict(data: dict) -> Config:
    """A `Config` from nested plain data (a YAML file's sections): unknown sections and keys,
    and values of the wrong type, are ConfigErrors; not validated (`Config.validate`)."""
    unknown = [k for k in data if k not in SECTIONS]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], list(SECTIONS), n=1)
        hint = f"did you mean {close[0]}?" if close else f"sections are {', '.join(SECTIONS)}."
        _fail(f"unknown config section {unknown[0]!r}; {hint}")
    hints = typing.get_type_hints(Config)
    return Config(**{k: _build(hints[k], v or {}, k) for k, v in data.items()})


def load(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """YAML file (or the built-in defaults when None) + `key.sub=value` overrides -> Config.

    Validates everything that does not need the device count; `Config.validate(n)` does the rest.
    """
    data = _read_yaml(Path(path)) if path is not None else {}
    return from_dict(apply_overrides(data, overrides)).validate()


def split_args(args: typing.Sequence[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG] [key=value ...]` as the command line gives them: the config file (or run
    directory) is the one argument without '='."""
    path = None
    overrides = []
    for a in args:
        if "=" in a:
            overrides.append(a)
        elif path is None:
            path = a
        else:
            _fail(f"unexpected argument {a!r}: give one CONFIG file, then key=value.")
    return path, overrides


def load_args(args: typing.Sequence[str]) -> Config:
    """`load` from command-line arguments. CONFIG may be a YAML file or an existing run
    directory, which stands for its config.yaml with `run.dir` set to it (training there
    resumes from its newest checkpoint)."""
    path, overrides = split_args(args)
    if path is not None and Path(path).is_dir():
        if not (Path(path) / "config.yaml").is_file():
            _fail(f"{path} is a directory without a config.yaml; give a run directory.")
        overrides = [f"run.dir={path}", *overrides]
        path = str(Path(path) / "config.yaml")
    return load(path, overrides)


def apply_overrides(data: dict, overrides: typing.Sequence[str]) -> dict:
    """Merges `key.sub=value` overrides (presets included) into a nested dict of sections, in
    place, and returns it."""
    for item in overrides:
        _deep_merge(data, _parse_override(item))
    return data


def to_dict(cfg: Config) -> dict:
    """The config as nested plain dicts and lists, as `dump` writes it; `from_dict` reads it."""

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(cfg))


def dump(cfg: Config, path: str | os.PathLike) -> None:
    """Writes the fully resolved config; `load(path)` reads it back to an equal Config. A config
    `load` would refuse is a ConfigError here, and nothing is written."""
    with warnings.catch_warnings():  # a warning is the run's to give, when it validates
        warnings.simplefilter("ignore")
        cfg.validate()
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
