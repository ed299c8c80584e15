"""Object storage (`s3://BUCKET/PATH`, `gs://BUCKET/PATH`) through fsspec: s3fs and gcsfs, the
libraries Orbax and Grain use too. No storage client of our own: endpoint and credentials come
from each library's standard environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`, `AWS_PROFILE`, ...; Google's application default
credentials, `STORAGE_EMULATOR_HOST`).

The rest of jaxllm works on local files. Inputs are fetched into a cache and read from there;
outputs are written into a local staging directory as usual and published when complete:

    fetch(url, key)        -> a local copy of an object, a prefix ("directory") or a glob, under
                              $JAXLLM_CACHE (default ~/.cache/jaxllm)/remote/<scheme>/<bucket>/<path>;
                              only objects whose size or etag changed are downloaded, each into
                              a temporary file renamed into place, so a killed download is never
                              read as complete
    publish(local, url, key, last=[...])  uploads a file or a tree; the names in `last` (commit
                              markers: a manifest, config.json, _CHECKPOINT_METADATA) go after
                              everything else, so a failed upload leaves no marker
    exists, listdir, remove(url, key)

`key` is the config key or option the URL came from, named in errors. Every failure is one
sentence, by `errors(url, key)` (a context manager the run mirror and its lock use too): a missing bucket, refused credentials or an unreachable endpoint are `RunError`s
(exit 1) naming the URL and the cause; a missing object is a `ConfigError` naming the key
(exit 2); a missing s3fs / gcsfs names the extra that installs it.
"""

from __future__ import annotations

import contextlib
import glob as globlib
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from jaxllm.config import ConfigError, RunError
from jaxllm.config.urls import check_url, is_url, split_url

__all__ = [
    "cache_dir",
    "check_url",
    "exists",
    "fetch",
    "filesystem",
    "is_url",
    "listdir",
    "local_cache",
    "publish",
    "remove",
]

_PACKAGES = {"s3": "s3fs", "gs": "gcsfs"}
_ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCE_", "STORAGE_EMULATOR_HOST", "CLOUDSDK_")
_filesystems: dict[tuple, object] = {}


def cache_dir() -> Path:
    """Where fetched inputs are kept: `$JAXLLM_CACHE`, else ~/.cache/jaxllm."""
    return Path(os.environ.get("JAXLLM_CACHE") or Path.home() / ".cache" / "jaxllm")


def local_cache(url: str) -> Path:
    """The place of `url`'s local copy: <cache>/remote/<scheme>/<bucket>/<path>."""
    scheme, bucket, path = split_url(url)
    return cache_dir() / "remote" / scheme / bucket / path


def _stamp_path(url: str) -> Path:
    scheme, bucket, path = split_url(url)
    return cache_dir() / "stamps" / scheme / bucket / path


def filesystem(url: str, key: str):
    """The fsspec filesystem of `url`'s scheme, made from the current environment (a changed
    endpoint or credential makes a new one). ConfigError when its package is not installed."""
    check_url(url, key)
    scheme = split_url(url)[0]
    package = _PACKAGES[scheme]
    try:
        __import__(package)
        import fsspec
    except ImportError:
        raise ConfigError(
            f"{key}={url} needs the package {package}; install it with "
            "pip install 'jaxllm[storage]'."
        ) from None
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    if (scheme, env) not in _filesystems:
        # their retries and fallbacks are logged with tracebacks; the failure that ends them is
        # reported here, as one sentence
        logging.getLogger(package).setLevel(logging.CRITICAL)
        # no listings cache: other processes write the same buckets
        _filesystems[scheme, env] = fsspec.filesystem(
            scheme, skip_instance_cache=True, use_listings_cache=False
        )
    return _filesystems[scheme, env]


def _remote(url: str) -> str:
    """`url` as fsspec names it: bucket/path."""
    _, bucket, path = split_url(url)
    return f"{bucket}/{path}" if path else bucket


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _endpoint(scheme: str) -> str:
    if scheme == "s3":
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
            "AWS_ENDPOINT_URL", "the S3 endpoint"
        )
    return os.environ.get("STORAGE_EMULATOR_HOST", "https://storage.googleapis.com")


def _cause(e: BaseException, url: str, fs) -> str | None:
    """The sentence that says why storage failed, or None when `e` is not a storage failure."""
    names = {k.__name__ for c in _chain(e) for k in type(c).__mro__}
    text = " ".join(str(c) for c in _chain(e)).lower()
    if names & {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"}:
        if split_url(url)[0] == "s3":
            return "no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
        return "no credentials found (run gcloud auth application-default login)"
    if names & {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ConnectionRefusedError",
        "TransportError",
    }:
        why = "connection refused"
        if any(isinstance(c, TimeoutError) for c in _chain(e)) or "timeout" in text:
            why = "timed out"
        elif "name or service not known" in text or "dns" in text or "nodename nor" in text:
            why = "unknown host"
        return f"cannot reach the endpoint {_endpoint(split_url(url)[0])} ({why})"
    if any(isinstance(c, PermissionError) for c in _chain(e)) or names & {"RefreshError"}:
        return "access denied (check the credentials)"
    if "nosuchbucket" in {n.lower() for n in names} or "bucket does not exist" in text:
        return "the bucket does not exist"
    if isinstance(e, FileNotFoundError) and fs is not None:
        bucket = split_url(url)[1]
        try:
            if not fs.exists(bucket):
                return "the bucket does not exist"
        except Exception:  # the bucket check itself failed: report the original error
            pass
    return None


@contextlib.contextmanager
def errors(url: str, key: str, fs=None, *, missing: str = "does not exist") -> Iterator[None]:
    """Storage failures inside the block as one sentence: RunError for the bucket, the
    credentials and the endpoint; ConfigError naming `key` for a missing object."""
    try:
        yield
    except (ConfigError, RunError):
        raise
    except Exception as e:
        cause = _cause(e, url, fs)
        if cause is not None:
            raise RunError(f"{url}: {cause}.") from None
        if isinstance(e, FileNotFoundError):
            raise ConfigError(f"{key}: {url} {missing}.") from None
        if isinstance(e, OSError | ValueError):
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise RunError(f"{url}: {first}.") from None
        raise


# ---------------------------------------------------------------- reading


def _remote_files(fs, url: str) -> tuple[str, dict[str, dict]]:
    """(the remote base, {path relative to it: info}) of an object, a prefix or a glob."""
    remote = _remote(url)
    if globlib.has_magic(remote):
        base = remote[: remote.find(next(c for c in remote if c in "*?["))].rsplit("/", 1)[0]
        found = fs.glob(remote, detail=True)
    else:
        info = fs.info(remote)
        if info["type"] != "directory":
            return remote.rsplit("/", 1)[0], {remote.rsplit("/", 1)[-1]: info}
        base, found = remote, fs.find(remote, detail=True)
    files = {p: i for p, i in found.items() if i.get("type") == "file"}
    return base, {p[len(base) :].lstrip("/"): i for p, i in files.items()}


def _stamp(info: dict) -> str:
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or ""
    return f"{info.get('size')} {str(etag).strip(chr(34))}"


def _download(fs, rpath: str, local: Path, stamp_file: Path, stamp: str) -> None:
    """`rpath` to `local` unless its stamp shows it is there already; atomically: a temporary
    sibling renamed into place, the stamp written after it and removed before."""
    if local.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    stamp_file.parent.mkdir(parents=True, exist_ok=True)
    stamp_file.unlink(missing_ok=True)
    tmp = local.with_name(f".{local.name}.partial-{os.getpid()}")
    try:
        fs.get_file(rpath, str(tmp))
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)
    tmp_stamp = stamp_file.with_name(f".{stamp_file.name}.partial-{os.getpid()}")
    tmp_stamp.write_text(stamp)
    os.replace(tmp_stamp, stamp_file)


def fetch(url: str, key: str) -> Path:
    """The local copy of `url` (an object, a prefix read as a directory tree, or a glob of
    objects), brought up to date: objects whose size or etag changed are downloaded, local
    files the remote no longer has are removed. For a glob, the local pattern. ConfigError
    naming `key` when nothing is there."""
    fs = filesystem(url, key)
    local_root = local_cache(url)
    with errors(url, key, fs):
        base, files = _remote_files(fs, url)
    if not files and globlib.has_magic(url):
        raise ConfigError(f"{key}: {url} matches no objects; check the pattern.")
    base_url = f"{split_url(url)[0]}://{base}"
    local_base, stamp_base = local_cache(base_url), _stamp_path(base_url)
    try:
        with errors(url, key, fs):
            for rel, info in sorted(files.items()):
                rpath = f"{base}/{rel}" if rel else base
                _download(fs, rpath, local_base / rel, stamp_base / rel, _stamp(info))
        if globlib.has_magic(url):
            stale = {Path(p) for p in globlib.glob(str(local_root), recursive=True)}
        elif local_root.is_dir():
            stale = {p for p in local_root.rglob("*") if p.is_file()}
        else:
            stale = set()
        for p in stale - {local_base / rel for rel in files}:
            if p.is_file() and ".partial-" not in p.name:
                p.unlink()
        if not files and not globlib.has_magic(url):  # an empty prefix: an empty directory
            local_root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(
            f"cannot copy {url} into the cache {cache_dir()} ({e.strerror or e}); set "
            "JAXLLM_CACHE to a writable directory with room."
        ) from None
    return local_root


# ---------------------------------------------------------------- writing


def _is_last(rel: str, last: Sequence[str]) -> int | None:
    """The position in `last` of the name `rel` (a path relative to the published root)
    matches, by its whole path or its file name; None when it is no marker."""
    name = rel.rsplit("/", 1)[-1]
    for i, marker in enumerate(last):
        if rel == marker or name == marker:
            return i
    return None


def publish(local: str | Path, url: str, key: str, *, last: Sequence[str] = ()) -> None:
    """Uploads the file or tree `local` to `url` (objects under it are replaced, others kept),
    the files named in `last` after all the others, in the order of `last`: a reader that
    sees a marker sees everything before it."""
    local = Path(local)
    fs = filesystem(url, key)
    remote = _remote(url)
    if local.is_file():
        with errors(url, key, fs):
            fs.put_file(str(local), remote)
        return
    rels = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    first = [r for r in rels if _is_last(r, last) is None]
    markers = sorted(
        (r for r in rels if _is_last(r, last) is not None),
        key=lambda r: (_is_last(r, last), r.count("/"), r),
    )
    with errors(url, key, fs):
        if not fs.exists(split_url(url)[1]):
            raise FileNotFoundError(f"{url}: bucket does not exist")
        if first:
            fs.put([str(local / r) for r in first], [f"{remote}/{r}" for r in first])
        for r in markers:
            fs.put_file(str(local / r), f"{remote}/{r}")


def exists(url: str, key: str) -> bool:
    """Whether an object or a non-empty prefix is at `url`. RunError when its bucket does not
    exist (or cannot be reached)."""
    fs = filesystem(url, key)
    with errors(url, key, fs):
        try:
            fs.info(_remote(url))
            return True
        except FileNotFoundError as e:
            if _cause(e, url, fs) is not None:
                raise
            return False


def listdir(url: str, key: str) -> list[str]:
    """The names directly under the prefix `url`, sorted; [] when there are none."""
    fs = filesystem(url, key)
    remote = _remote(url)
    with errors(url, key, fs):
        try:
            entries = fs.ls(remote, detail=False)
        except FileNotFoundError as e:
            if _cause(e, url, fs) is not None:
                raise
            return []
    return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != remote})


def remove(url: str, key: str) -> None:
    """Deletes the object or every object under the prefix `url`; nothing there is no error."""
    fs = filesystem(url, key)
    with errors(url, key, fs):
        if exists(url, key):
            fs.rm(_remote(url), recursive=True)


@contextlib.contextmanager
def staged(out: str | Path, flag: str, *, overwrite: bool, last: Sequence[str]) -> Iterator[Path]:
    """The local directory to write the output `out` into: `out` itself when it is local; for
    a URL, its place in the cache (where `fetch` puts it, so paths the output records hold
    there), published to the URL with the markers `last` at the end once the block succeeds.

    A URL whose final marker (`last[-1]`) exists holds a finished output: refused before the
    block runs unless `overwrite`. One without it holds at most an upload that failed, which
    is replaced without asking. The old objects are removed only once the new output is
    complete locally; if the upload then fails, the URL holds no marker."""
    if not is_url(str(out)):
        yield Path(out)
        return
    url = check_url(str(out), flag)
    finished = exists(f"{url.rstrip('/')}/{last[-1]}", flag)  # also: bucket, credentials
    if finished and not overwrite:
        raise ConfigError(
            f"{flag} {url} already holds files; choose a new directory, or pass --overwrite "
            "to replace it."
        )
    local = local_cache(url)
    try:
        if local.is_dir():  # a fetched copy of what is replaced
            shutil.rmtree(local)
        elif local.exists():
            local.unlink()
        local.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(
            f"cannot stage {url} in the cache {cache_dir()} ({e.strerror or e})."
        ) from None
    yield local
    remove(url, flag)
    publish(local, url, flag, last=last)
