"""Bad OUT of `jaxllm convert export RUN OUT --format gguf`: a file that is not GGUF under
--overwrite (a run's config.yaml), a directory, a path under a file, and a bucket. Each row
runs as test_faults_quantize's do (`check_fault`): exit 2, one `jaxllm:` line, the run and the
scratch directory unchanged."""

from __future__ import annotations

import pytest
from test_faults import Case
from test_faults_quantize import _existing_out, check_fault

CASES = [
    Case(
        "gguf-overwrite-of-a-file-that-is-not-gguf",
        lambda r, t: [
            "convert",
            "export",
            str(r),
            str(r / "config.yaml"),
            "--format",
            "gguf",
            "--overwrite",
        ],
        2,
        "config.yaml is not a GGUF file; --overwrite replaces only one",
    ),
    Case(
        "gguf-out-a-directory-with-overwrite",
        lambda r, t: [
            "convert",
            "export",
            str(r),
            str(t / "out"),
            "--format",
            "gguf",
            "--overwrite",
        ],
        2,
        "out is a directory; --format gguf writes one file",
        setup=_existing_out,
    ),
    Case(
        "gguf-out-under-a-file",
        lambda r, t: [
            "convert",
            "export",
            str(r),
            str(r / "config.yaml" / "m.gguf"),
            "--format",
            "gguf",
        ],
        2,
        "m.gguf cannot be made: ",
    ),
    Case(
        "gguf-out-in-a-bucket",
        lambda r, t: ["convert", "export", str(r), "s3://bucket/m.gguf", "--format", "gguf"],
        2,
        "OUT s3://bucket/m.gguf: --format gguf writes a local file",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gguf_fault(case: Case, small_run, tmp_path, capsys):
    check_fault(case, small_run, tmp_path, capsys)
