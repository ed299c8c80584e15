"""The built-in corpus: the running Python's standard-library sources, found via `sysconfig`.

Every machine that runs jaxllm has them, so the default run downloads nothing. Files are split
into train and eval deterministically by a CRC32 of their path relative to the stdlib root.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path


def stdlib_files(max_files: int | None = None) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "__pycache__" not in p.parts and p.is_file()
    )  # fmt: skip
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library at {root}")
    return files[:max_files] if max_files else files


def split_files(files: list[Path], eval_fraction: float) -> tuple[list[Path], list[Path]]:
    """(train, eval): a file is held out when crc32(relative path) falls in the eval fraction."""
    root = Path(sysconfig.get_paths()["stdlib"])
    threshold = int(eval_fraction * 2**32)

    def held_out(p: Path) -> bool:
        return zlib.crc32(str(p.relative_to(root)).encode()) < threshold

    train = [p for p in files if not held_out(p)]
    held = [p for p in files if held_out(p)]
    if not held or not train:
        raise ValueError(
            f"data.eval_fraction={eval_fraction} leaves {len(train)} train and {len(held)} eval "
            f"files of {len(files)}; choose a fraction that leaves both non-empty."
        )
    return train, held
