"""jaxllm.storage against a real S3-compatible server (moto, `tests/objectstore.py`): URL
checks, fetch into the cache and publish with commit markers last, and every failure as one
sentence of the right kind."""

from __future__ import annotations

import sys

import pytest

from jaxllm import storage
from jaxllm.config import ConfigError, RunError


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


@pytest.mark.parametrize(
    "value, says",
    [
        ("http://host/x", "http:// is not storage jaxllm reads"),
        ("gcs://bkt/x", "gcs:// is not storage jaxllm reads"),
        ("s3:/bkt/x", "is not a URL; write it s3://BUCKET/PATH"),
        ("s3://", "names no bucket"),
        ("gs:///x", "names no bucket"),
        ("s3://ab/x", "'ab' is not a valid bucket name"),
        ("s3://Bad_Bucket/x", "'Bad_Bucket' is not a valid bucket name"),
        ("s3://a..b/x", "'a..b' is not a valid bucket name"),
    ],
)
def test_malformed_urls_are_refused_naming_the_key(value, says):
    with pytest.raises(ConfigError) as e:
        storage.check_url(value, "data.sources[0].path")
    assert one_line(e).startswith(f"data.sources[0].path={value}")
    assert says in str(e.value)


@pytest.mark.parametrize(
    "value", ["s3://bkt/x", "gs://my_bucket.v1/a/b", "s3://bkt", "runs/x", "/abs/p", "stdlib"]
)
def test_local_paths_and_good_urls_pass(value):
    assert storage.check_url(value, "k") == value
    assert storage.is_url(value) == value.startswith(("s3://", "gs://"))


def test_a_tree_round_trips_and_only_changed_objects_download(s3_env, tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "b.txt").write_text("beta")
    url = s3_env.bucket() + "/data"
    storage.publish(src, url, "--out")
    assert storage.exists(url, "k") and not storage.exists(url + "/nothing", "k")
    assert storage.listdir(url, "k") == ["a.txt", "sub"]

    local = storage.fetch(url, "k")
    assert local == storage.cache_dir() / "remote/s3" / url.removeprefix("s3://")
    assert (local / "a.txt").read_text() == "alpha" and (local / "sub/b.txt").read_text() == "beta"

    fs = storage.filesystem(url, "k")
    got = []
    real_get = fs.get_file
    monkeypatch.setattr(fs, "get_file", lambda r, lp, **kw: (got.append(r), real_get(r, lp))[1])
    storage.fetch(url, "k")
    assert got == []  # nothing changed: nothing downloaded
    (src / "a.txt").write_text("alpha, longer")
    storage.publish(src / "a.txt", url + "/a.txt", "k")
    fs.rm(url.removeprefix("s3://") + "/sub/b.txt")
    storage.fetch(url, "k")
    assert [g.rsplit("/", 1)[-1] for g in got] == ["a.txt"]
    assert (local / "a.txt").read_text() == "alpha, longer"
    assert not (local / "sub/b.txt").exists()  # gone remotely: gone from the cache

    one = storage.fetch(url + "/a.txt", "k")
    assert one.read_text() == "alpha, longer" and one == local / "a.txt"
    pattern = storage.fetch(url + "/*.txt", "k")
    assert pattern == local / "*.txt"
    storage.remove(url, "k")
    assert not storage.exists(url, "k") and storage.listdir(url, "k") == []


def test_a_killed_download_is_never_read_as_complete(s3_env, tmp_path, monkeypatch):
    url = s3_env.bucket() + "/f.bin"
    (tmp_path / "f.bin").write_bytes(b"x" * 1000)
    storage.publish(tmp_path / "f.bin", url, "k")
    fs = storage.filesystem(url, "k")

    def torn(rpath, lpath, **kw):
        with open(lpath, "wb") as f:
            f.write(b"x" * 10)
        raise KeyboardInterrupt  # killed mid-download

    monkeypatch.setattr(fs, "get_file", torn)
    with pytest.raises(KeyboardInterrupt):
        storage.fetch(url, "k")
    local = storage.local_cache(url)
    assert not local.exists()
    assert not [p for p in local.parent.iterdir()]  # no temporary file left either
    monkeypatch.undo()
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    for k, v in s3_env.env.items():
        monkeypatch.setenv(k, v)
    assert storage.fetch(url, "k").read_bytes() == b"x" * 1000


def test_markers_are_published_last(s3_env, tmp_path, monkeypatch):
    out = tmp_path / "out"
    (out / "1").mkdir(parents=True)
    for name in ("a", "b", "manifest.json", "1/_CHECKPOINT_METADATA", "1/z"):
        (out / name).write_text(name)
    url = s3_env.bucket() + "/prepared"
    fs = storage.filesystem(url, "k")
    seen = {}
    real_put_file = fs.put_file

    def put_file(lpath, rpath, **kw):  # what a reader sees when each marker lands
        seen[rpath.rsplit("/", 1)[-1]] = s3_env.keys(url)
        return real_put_file(lpath, rpath, **kw)

    monkeypatch.setattr(fs, "put_file", put_file)
    storage.publish(out, url, "k", last=["_CHECKPOINT_METADATA", "manifest.json"])
    key = url.removeprefix("s3://").split("/", 1)[1]
    assert set(seen["_CHECKPOINT_METADATA"]) == {f"{key}/{n}" for n in ("a", "b", "1/z")}
    assert f"{key}/1/_CHECKPOINT_METADATA" in seen["manifest.json"]
    assert list(seen) == ["_CHECKPOINT_METADATA", "manifest.json"]

    url2 = url + "2"

    def broken_put(*a, **kw):
        raise OSError("connection reset")

    monkeypatch.setattr(fs, "put", broken_put)
    with pytest.raises(RunError) as e:
        storage.publish(out, url2, "k", last=["manifest.json"])
    assert one_line(e) == f"{url2}: connection reset."
    assert not [k for k in s3_env.keys(url2) if k.endswith("manifest.json")]


def test_failures_are_one_sentence_each(s3_env, monkeypatch, tmp_path):
    url = s3_env.bucket()
    with pytest.raises(ConfigError) as e:
        storage.fetch(url + "/missing.jsonl", "data.sources[0].path")
    assert one_line(e) == f"data.sources[0].path: {url}/missing.jsonl does not exist."
    with pytest.raises(RunError) as e:
        storage.fetch("s3://nobucket-here/run", "k")
    assert one_line(e) == "s3://nobucket-here/run: the bucket does not exist."
    with pytest.raises(RunError) as e:
        storage.exists("s3://nobucket-here/run", "k")
    assert one_line(e) == "s3://nobucket-here/run: the bucket does not exist."

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws either
    with pytest.raises(RunError) as e:
        storage.fetch(url + "/x", "k")
    assert one_line(e) == (
        f"{url}/x: no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)."
    )
    for name, value in s3_env.env.items():
        monkeypatch.setenv(name, value)

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.denying_env()["AWS_ENDPOINT_URL"])
    with pytest.raises(RunError) as e:
        storage.fetch(url + "/x", "k")
    assert one_line(e) == f"{url}/x: access denied (check the credentials)."

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(RunError) as e:
        storage.exists(url + "/x", "k")
    assert one_line(e) == (
        f"{url}/x: cannot reach the endpoint http://127.0.0.1:1 (connection refused)."
    )


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # import gcsfs -> ImportError
    with pytest.raises(ConfigError) as e:
        storage.filesystem("gs://bkt/x", "checkpoint.init_from")
    assert one_line(e) == (
        "checkpoint.init_from=gs://bkt/x needs the package gcsfs; install it with "
        "pip install 'jaxllm[storage]'."
    )
