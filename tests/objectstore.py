"""A real S3-compatible server for the tests: moto's server mode on 127.0.0.1.

    def test_x(s3):            # the session's server (one per pytest-xdist worker)
        url = s3.bucket()      # a fresh bucket: "s3://b-..."
        run(["jaxllm", ...], env=cpu_env(**s3.env))   # a subprocess gets the variables

    def test_y(s3_env):        # the same server, its variables set in os.environ for this
        storage.fetch(...)     # test only (monkeypatch), and $JAXLLM_CACHE in tmp_path

`s3.env` holds AWS_ENDPOINT_URL, test credentials and the region; nothing is set in os.environ
outside `s3_env`. `s3.denying_env()` is the environment of a second server that knows no
credentials (moto with authentication on and no users): every request is refused, as real S3
refuses a wrong secret key (moto's ordinary server accepts any key).
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(extra_env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, **(extra_env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto server did not start on {endpoint}") from None
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ObjectStore:
    """A running moto server: its environment and fresh buckets."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        self._names = itertools.count()
        self._denying: tuple[subprocess.Popen, str] | None = None

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )

    def bucket(self, name: str | None = None) -> str:
        """Creates a bucket (a fresh name unless given) and returns its URL, `s3://name`."""
        name = name or f"b{next(self._names)}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def keys(self, url: str) -> list[str]:
        """Every object key under the URL's bucket and prefix, sorted."""
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def denying_env(self) -> dict:
        """The environment of a server that refuses every request's credentials (started on
        first use, stopped with this one)."""
        if self._denying is None:
            self._denying = _start({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
        return {**self.env, "AWS_ENDPOINT_URL": self._denying[1]}

    def close(self) -> None:
        if self._denying is not None:
            _stop(self._denying[0])


@pytest.fixture(scope="session")
def s3():
    """The moto server of this test session (of this xdist worker)."""
    proc, endpoint = _start()
    store = ObjectStore(endpoint)
    try:
        yield store
    finally:
        store.close()
        _stop(proc)


@pytest.fixture
def s3_env(s3, monkeypatch, tmp_path):
    """`s3` with its variables in os.environ for this test, and a fresh $JAXLLM_CACHE."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    return s3
