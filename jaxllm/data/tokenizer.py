"""Tokenizers: UTF-8 bytes (the default), Hugging Face `tokenizer.json`, SentencePiece `.model`.

Every tokenizer maps text to int32 ids without adding special tokens; the packer adds BOS / EOS
as `data.add_bos` / `data.add_eos` ask (`make_tokenizer` refuses them for a missing token).

`data.tokenizer: none` marks a run without a tokenizer (a Hugging Face model imported without
tokenizer.json whose vocabulary is too small for bytes): it computes logits from ids, and
`load_tokenizer` refuses it wherever text must be encoded or decoded.

`encode_offsets` gives each id the characters it comes from (the SFT loss mask is cut by them,
`jaxllm.data.chat`); with `specials=True` it reads text spelling a special token ("<|im_end|>")
as that token, as `apply_chat_template` does with what a chat template writes. `special_tokens`
are the strings a chat template sees as `bos_token`, `eos_token`, ...

`train_bpe` trains a byte-level BPE (GPT-2 style: every byte is in the alphabet, so no text is
ever unknown) with `<pad>`, `<bos>`, `<eos>` as ids 0, 1, 2, and writes `DIR/tokenizer.json`.

This module does not import jax: `tokenizer_vocab_size` and `check_vocab` stay cheap."""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from jaxllm import storage
from jaxllm.config import ConfigError, JaxllmWarning
from jaxllm.data import detect

BPE_SPECIALS = ("<pad>", "<bos>", "<eos>")
# Names a tokenizer.json may give its specials when no tokenizer_config.json says which they are.
# The specials a chat template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES).
_TEMPLATE_SPECIALS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
# BERT's [CLS] / [SEP] (declared as cls_token / sep_token) serve as its BOS / EOS.
_SPECIAL_NAMES = {
    "bos": ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[BOS]", "[CLS]"),
    "eos": ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "[EOS]", "[SEP]"),
    "pad": ("<pad>", "<|pad|>", "[PAD]"),
    "mask": ("[MASK]", "<mask>"),  # masked LM's mask token (BERT, RoBERTa)
}


def _as_text(text: str | bytes) -> str:
    return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; BOS = 256, EOS = 257; padding uses id 0."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    pad_id = 0
    found_pad_id = 0
    mask_id = None  # no mask token: masked LM takes train.mask_token_id or id 258
    name = "byte"
    chat_template = None
    special_tokens: dict[str, str] = {}  # BOS and EOS are ids past the bytes: no text spells them

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def encode_offsets(self, text: str, specials: bool = False) -> tuple[np.ndarray, np.ndarray]:
        ids = self.encode(text)
        # every byte but a UTF-8 continuation byte (0b10xxxxxx) starts the next character
        char = np.cumsum((ids & 0xC0) != 0x80) - 1
        return ids, np.stack([char, char + 1], axis=1)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids)
        return bytes(ids[(ids >= 0) & (ids < 256)].astype(np.uint8)).decode("utf-8", "replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json. Specials come from a `tokenizer_config.json`
    beside it (bos_token, eos_token, pad_token, mask_token) when there is one, else from common
    names.

    `chat_template` is the model's default chat template (Jinja text) and `chat_templates` all
    of its named ones, as transformers reads them: a `chat_template.jinja` beside the file, else
    tokenizer_config.json's `chat_template`, a string or a list of {name, template}; None and
    {} when there is none."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))
        # text that spells a special ("<eos>" in a document) is text: BOS/EOS come only from the
        # packer, never from the data
        self._tok.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config_path = path.parent / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_path} is not a JSON object")
        declared = {}
        for kind in ("bos", "eos", "pad", "mask"):
            value = config.get(f"{kind}_token")
            declared[kind] = value.get("content") if isinstance(value, dict) else value
        for kind, alias in (("bos", "cls_token"), ("eos", "sep_token")):  # BERT
            value = config.get(alias)
            value = value.get("content") if isinstance(value, dict) else value
            declared[kind] = declared[kind] or value
        for kind, names in _SPECIAL_NAMES.items():
            candidates = (declared[kind],) if declared.get(kind) else names
            ids = [self._tok.token_to_id(n) for n in candidates if n]
            setattr(self, f"{kind}_id", next((i for i in ids if i is not None), None))
        self.found_pad_id = self.pad_id  # None: no pad token (pad_id then falls back to 0)
        self.pad_id = self.pad_id if self.pad_id is not None else 0
        self.chat_templates = _chat_templates(path.parent, config.get("chat_template"))
        self.chat_template = self.chat_templates.get("default")
        # what transformers passes a chat template: the tokens tokenizer_config.json names (or,
        # without that file, the specials found by their common names)
        named = {f"{k}_token": config.get(f"{k}_token") for k in _TEMPLATE_SPECIALS}
        if not config_path.is_file():
            found = {
                "bos_token": self.bos_id,
                "eos_token": self.eos_id,
                "pad_token": self.found_pad_id,
            }
            named |= {k: self._tok.id_to_token(i) for k, i in found.items() if i is not None}
        named = {k: v.get("content") if isinstance(v, dict) else v for k, v in named.items()}
        self.special_tokens = {k: v for k, v in named.items() if isinstance(v, str)}
        self._with_specials = None  # a copy that reads specials in text, for chat templates

    def encode(self, text: str | bytes) -> np.ndarray:
        # add_special_tokens=False: a post-processor template must not add BOS/EOS behind the
        # packer's back; data.add_bos / data.add_eos decide.
        ids = self._tok.encode(_as_text(text), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch([_as_text(t) for t in texts], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def encode_offsets(self, text: str, specials: bool = False) -> tuple[np.ndarray, np.ndarray]:
        tok = self._tok
        if specials:
            if self._with_specials is None:
                from tokenizers import Tokenizer

                self._with_specials = Tokenizer.from_str(self._tok.to_str())
                self._with_specials.encode_special_tokens = False
            tok = self._with_specials
        enc = tok.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, np.int32), np.asarray(enc.offsets, np.int64).reshape(-1, 2)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]  # a model may sample past the vocabulary
        return self._tok.decode(ids.tolist(), skip_special_tokens=True)

    def to_str(self) -> str:  # the tokenizer.json text (structured outputs give llguidance)
        return self._tok.to_str()


def _chat_templates(directory: Path, value) -> dict[str, str]:
    """Named chat templates: chat_template.jinja (which transformers prefers), else
    tokenizer_config.json's `chat_template` (a string is the default one)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return {"default": jinja.read_text()}
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(
        "tokenizer_config.json chat_template is neither a string nor a list of {name, template}"
    )


class SentencePieceTokenizer:
    """A SentencePiece `.model`; its own BOS/EOS/PAD ids (-1 in the model means none)."""

    chat_template = None

    def __init__(self, path: Path):
        import sentencepiece as spm

        self.name = str(path)
        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self.found_pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else None
        self.pad_id = self.found_pad_id if self.found_pad_id is not None else 0
        self.mask_id = None  # SentencePiece models declare no mask token
        ids = {"bos": self.bos_id, "eos": self.eos_id, "unk": self._sp.unk_id()}
        ids["pad"] = self.found_pad_id
        self.special_tokens = {
            f"{k}_token": self._sp.id_to_piece(i)
            for k, i in ids.items()
            if i is not None and i >= 0
        }

    def encode(self, text: str | bytes) -> np.ndarray:
        return np.asarray(self._sp.encode(_as_text(text)), dtype=np.int32)

    def encode_offsets(self, text: str, specials: bool = False) -> tuple[np.ndarray, np.ndarray]:
        # SentencePiece never reads a control token out of text, so `specials` changes nothing
        out = self._sp.encode(text, out_type="offset_mapping")
        return np.asarray(out["ids"], np.int32), np.asarray(out["offsets"], np.int64).reshape(-1, 2)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        ids = self._sp.encode([_as_text(t) for t in texts])
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids)
        return self._sp.decode(ids[(ids >= 0) & (ids < self.vocab_size)].tolist())


Tokenizer = ByteTokenizer | HFTokenizer | SentencePieceTokenizer
NO_TOKENIZER = "none"  # data.tokenizer of a run that has none


# read beside a tokenizer.json (`HFTokenizer`, `generation_config`): fetched with it from a bucket
_BESIDE = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def fetched_tokenizer(spec: str, key: str = "data.tokenizer") -> str:
    """`spec` unchanged, or for a `gs://` / `s3://` URL (a tokenizer.json or .model, or a
    directory holding tokenizer.json) the path of its local copy, with the files read beside
    it (`jaxllm.storage.fetch`)."""
    if not storage.is_url(spec):
        return spec
    url = spec.rstrip("/")
    if not url.endswith((".json", ".model")):
        url += "/tokenizer.json"
    local = storage.fetch(url, key)
    parent = url.rsplit("/", 1)[0]
    for name in _BESIDE if url.endswith(".json") else ():
        if storage.exists(f"{parent}/{name}", key):
            storage.fetch(f"{parent}/{name}", key)
        else:
            (local.parent / name).unlink(missing_ok=True)
    return str(local)


def _tokenizer_file(spec: str, key: str) -> Path:
    """The file a `data.tokenizer` value names (a directory stands for its tokenizer.json; a
    URL for its local copy)."""
    path = Path(fetched_tokenizer(spec, key)).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"{key}={spec!r} is neither `byte` nor an existing tokenizer.json or SentencePiece "
            ".model file; check the path (`jaxllm data tokenizer` trains one)."
        )
    if path.suffix not in (".json", ".model"):
        raise ConfigError(
            f"{key}={spec!r} must end in .json (Hugging Face tokenizers) or .model (SentencePiece)."
        )
    return path


@functools.lru_cache(maxsize=8)
def _load(path: Path, mtime_ns: int) -> Tokenizer:
    try:
        return HFTokenizer(path) if path.suffix == ".json" else SentencePieceTokenizer(path)
    except Exception as e:  # the libraries raise bare Exception/RuntimeError on bad files
        raise ConfigError(f"cannot read tokenizer {path}: {str(e).splitlines()[0]}") from e


def load_tokenizer(spec: str, key: str = "data.tokenizer") -> Tokenizer:
    """`byte`, a tokenizer.json (or a directory holding one), or a SentencePiece .model;
    ConfigError for `none` (a run without a tokenizer), which has no text to give."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == NO_TOKENIZER:
        raise ConfigError(
            f"{key}=none: this run has no tokenizer (imported without one); set "
            f"{key}=PATH to a tokenizer.json to encode or decode text."
        )
    path = _tokenizer_file(spec, key).resolve()
    return _load(path, path.stat().st_mtime_ns)


def make_tokenizer(data_cfg) -> Tokenizer:
    """The tokenizer of a DataConfig; ConfigError if add_bos/add_eos ask for a missing token,
    unless every source is chat (its template writes BOS / EOS; a Qwen tokenizer has none)."""
    tok = load_tokenizer(data_cfg.tokenizer)
    for flag, kind in (("add_bos", "bos"), ("add_eos", "eos")):
        missing = getattr(data_cfg, flag) and getattr(tok, f"{kind}_id") is None
        if missing and not detect.all_chat(data_cfg):
            raise ConfigError(
                f"data.{flag}=true but tokenizer {tok.name} has no {kind.upper()} token; set "
                f"data.{flag}=false or use a tokenizer that defines one."
            )
    return tok


def tokenizer_vocab_size(data_cfg) -> int:
    """Ids the tokenizer can emit (258 for bytes, 0 for none); reads only the tokenizer file."""
    if data_cfg.tokenizer == NO_TOKENIZER:
        return 0
    return load_tokenizer(data_cfg.tokenizer).vocab_size


def check_vocab(data_cfg, vocab_size: int) -> None:
    """ConfigError when a model of `vocab_size` ids cannot take every id the tokenizer emits.
    Checked where data meets the model (training start-up, eval, generation), before anything
    is compiled; the config alone does not read tokenizer files."""
    n = tokenizer_vocab_size(data_cfg)
    if vocab_size < n:
        raise ConfigError(
            f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's vocabulary ({n}); "
            "raise model.vocab_size."
        )


# (tokenizer, model vocabulary) pairs already warned about by `check_coverage` in this process
_COVERAGE_WARNED: set[tuple[str, int]] = set()


def check_coverage(tok: Tokenizer, vocab_size: int, where: str) -> None:
    """Warns (once per tokenizer and vocabulary size) when a model's vocabulary is more than
    twice the tokenizer's: such a model was made for another tokenizer (a Hugging Face model
    imported without its tokenizer.json gets the byte tokenizer), and what it says in the ids
    this tokenizer lacks would silently decode to nothing. Twice, not merely more, because
    vocabularies are padded: jaxllm's presets give the byte tokenizer's 258 ids 384 rows, and
    Hugging Face models round theirs up to multiples of 64 or 128."""
    if vocab_size <= 2 * tok.vocab_size or (tok.name, vocab_size) in _COVERAGE_WARNED:
        return
    _COVERAGE_WARNED.add((tok.name, vocab_size))
    warnings.warn(
        f"{where}: model.vocab_size is {vocab_size} but tokenizer {tok.name} has "
        f"{tok.vocab_size} ids, so the model was made for another tokenizer and ids >= "
        f"{tok.vocab_size} decode to nothing; copy the model's tokenizer.json into the run "
        "directory and set data.tokenizer to it.",
        JaxllmWarning,
        stacklevel=2,
    )


GENERATION_CONFIG = "generation_config.json"


def generation_config(spec: str, run_dir=None) -> dict:
    """A run's generation_config.json (imported with a Hugging Face model: its EOS ids and
    sampling defaults), beside its tokenizer file or else in `run_dir`; {} when there is none."""
    places = []
    if spec not in ("byte", NO_TOKENIZER):  # a tokenizer file, or a directory holding one
        path = Path(spec).expanduser()
        places.append(path if path.is_dir() else path.parent)
    places += [Path(run_dir)] if run_dir is not None else []
    for place in places:
        if (place / GENERATION_CONFIG).is_file():
            return _generation_config(place / GENERATION_CONFIG)
    return {}


def _generation_config(path: Path) -> dict:
    try:
        out = json.loads(path.read_bytes())
    except ValueError as e:  # invalid JSON or not UTF-8
        raise ConfigError(
            f"{path} is not valid JSON ({str(e).splitlines()[0]}); fix it or delete it."
        ) from None
    eos = out.get("eos_token_id") if isinstance(out, dict) else None
    ok_eos = eos is None or _is_id(eos) or (isinstance(eos, list) and all(map(_is_id, eos)))
    if not isinstance(out, dict) or not ok_eos:
        raise ConfigError(
            f"{path} must be a JSON object whose eos_token_id is a token id or a list of them; "
            "fix it or delete it."
        )
    return out


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def generation_stop_ids(gen: dict | Path) -> set[int]:
    """The `eos_token_id` (one id or a list) of a generation config, or of its file."""
    eos = (gen if isinstance(gen, dict) else _generation_config(Path(gen))).get("eos_token_id")
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def tokenizer_fingerprint(spec: str) -> str:
    """`byte`, or the SHA-256 of the tokenizer file: prepared data records it, so training with
    another tokenizer (even one at the same path, retrained) is caught."""
    if spec in ("byte", NO_TOKENIZER):
        return spec
    return hashlib.sha256(_tokenizer_file(spec, "tokenizer").read_bytes()).hexdigest()


def encode_documents(tok: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text, dropping texts that give no tokens (both on-the-fly loading and
    `prepare` go through here, so they keep exactly the same documents)."""
    return [ids for ids in tok.encode_batch(texts) if len(ids)]


def check_bpe_vocab_size(vocab_size: int) -> None:
    """ConfigError when a byte-level BPE cannot have `vocab_size` ids."""
    minimum = 256 + len(BPE_SPECIALS)
    if vocab_size < minimum:
        raise ConfigError(
            f"vocab size {vocab_size} is too small: a byte-level BPE needs at least {minimum} "
            f"ids (256 bytes + {', '.join(BPE_SPECIALS)})."
        )


def train_bpe(
    texts: Iterable[str], vocab_size: int, out_dir: str | Path, specials: Sequence[str] = ()
) -> Path:
    """Trains a byte-level BPE of `vocab_size` ids (specials and the 256 bytes included) on
    `texts`, with `specials` as ids 3, 4, ...; writes and returns `out_dir/tokenizer.json`
    (`jaxllm data tokenizer` gives a temporary directory that becomes its --out when complete)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_bpe_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*BPE_SPECIALS, *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # written here, not by tok.save, whose failed writes raise a bare Exception, not OSError
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True))
    return out / "tokenizer.json"
