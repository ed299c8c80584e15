"""Object-storage URLs in path keys: what a `gs://` or `s3://` URL must look like.

Keys that name an input or output (`data.sources[*].path`, `checkpoint.init_from`,
`train.teacher`, ...) take a local path or a URL `s3://BUCKET/PATH` / `gs://BUCKET/PATH`. Here,
at the bottom floor and without any storage library, is the check of the URL's form, so that a
config load refuses a malformed one before anything is read or written; `jaxllm.storage`
reads and writes the objects.
"""

from __future__ import annotations

import re

from jaxllm.config.errors import ConfigError

SCHEMES = ("s3", "gs")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/")  # two letters or more: not C:/
# S3's and GCS's rules, the common part: 3-63 characters, lowercase letters, digits, dots and
# hyphens (GCS also underscores), starting and ending with a letter or digit
_BUCKET = {
    "s3": re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"),
    "gs": re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$"),
}


def is_url(path) -> bool:
    """Whether `path` is an object-storage URL (`gs://...` or `s3://...`)."""
    return isinstance(path, str) and path.startswith(tuple(f"{s}://" for s in SCHEMES))


def looks_like_url(value) -> bool:
    """Whether `value` is written as a URL of any scheme (`http://x`, `s3:/x`)."""
    return isinstance(value, str) and _SCHEME.match(value) is not None


def split_url(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, path inside the bucket, no leading or trailing slash) of a URL."""
    scheme, rest = url.split("://", 1)
    bucket, _, path = rest.partition("/")
    return scheme, bucket, path.strip("/")


def check_url(value: str, key: str) -> str:
    """`value` unchanged when it is a local path or a well-formed `s3://` / `gs://` URL;
    ConfigError naming `key` when it is written as a URL that jaxllm cannot read."""
    m = _SCHEME.match(value) if isinstance(value, str) else None
    if m is None:
        return value
    scheme = m.group(1)
    form = "a local path, s3://BUCKET/PATH or gs://BUCKET/PATH"
    if scheme not in SCHEMES:
        raise ConfigError(f"{key}={value}: {scheme}:// is not storage jaxllm reads; give {form}.")
    if not value.startswith(f"{scheme}://"):
        raise ConfigError(f"{key}={value} is not a URL; write it {scheme}://BUCKET/PATH.")
    _, bucket, _ = split_url(value)
    if not bucket:
        raise ConfigError(f"{key}={value} names no bucket; write it {scheme}://BUCKET/PATH.")
    if not _BUCKET[scheme].match(bucket) or ".." in bucket:
        raise ConfigError(
            f"{key}={value}: {bucket!r} is not a valid bucket name (3-63 lowercase letters, "
            "digits, dots and hyphens, starting and ending with a letter or digit)."
        )
    return value


def validate_urls(cfg) -> None:
    """Every path key of `cfg` (a `Config`) that may be a URL, checked by `check_url`: data
    sources, `data.tokenizer`, `checkpoint.init_from`, `train.teacher` / `train.reference` / `train.reward`
    (a reward model's directory; the function specs `exact_match`, `regex:...` are not
    paths)."""
    for name in ("sources", "eval_sources"):
        for i, src in enumerate(getattr(cfg.data, name)):
            check_url(src.path, f"data.{name}[{i}].path")
    keys = {
        "data.tokenizer": cfg.data.tokenizer,
        "checkpoint.init_from": cfg.checkpoint.init_from,
        "train.teacher": cfg.train.teacher,
        "train.reference": cfg.train.reference,
    }
    if not cfg.train.reward.startswith("regex:"):
        keys["train.reward"] = cfg.train.reward
    for key, value in keys.items():
        if value:
            check_url(value, key)
