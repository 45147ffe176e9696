"""Output files: checked before any work starts, written whole or not at all.

`check_out_dir` / `check_out_file` prove a destination can take a file (nothing in the way, a
test write succeeds) without creating anything, so a run refused at the command line leaves
no trace. `atomic_path` writes to a hidden temporary name beside the target and renames it
over the target only once the writer succeeded: a crash or a full disk leaves the old file
(or none), never a truncated one.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

from mosaic.errors import MosaicError


def portable_stem(label: str) -> str:
    """`label` (a plan's, say `megatron@bucket_view=true`) as a portable file name: characters
    other than letters, digits, `.`, `_` and `-` become `_` (`@` and `=` do not survive every
    copy tool or file system)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", label)


class OutputError(MosaicError):
    """An output path that cannot be written; the message names the option and the fix."""


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path.cwd()


def _test_write(directory: Path, option: str, target: Path) -> None:
    try:  # a named file (a real create, unlike O_TMPFILE), one byte, flushed: a full disk
        # fails here rather than after the work; deleted on close
        with tempfile.NamedTemporaryFile(prefix=".mosaic-write-test-", dir=directory) as f:
            f.write(b"\0")
            f.flush()
    except OSError as exc:
        raise OutputError(f"{option} {target}: cannot write in {directory} ({exc.strerror}); "
                          f"choose a writable location") from None


def check_out_dir(path: Path, option: str = "--out") -> Path:
    """`path` is, or can become, a writable directory; creates nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{option} {path}: is a file; pass a directory path")
    _check_writable_under(path, option)
    return path


def check_out_file(path: Path, option: str) -> Path:
    """`path` can be (over)written as a file; creates nothing."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{option} {path}: is a directory; pass a file path")
    _check_writable_under(path.parent, option, target=path)
    return path


def _check_writable_under(directory: Path, option: str, target: Path | None = None) -> None:
    """The deepest existing part of `directory` is a directory that takes a file."""
    target = target or directory
    existing = _nearest_existing(directory)
    if not existing.is_dir():
        raise OutputError(f"{option} {target}: is under {existing}, which is a file; "
                          f"pass a path in a directory")
    _test_write(existing, option, target)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` (same suffix, so writers that infer the format from it
    work), renamed onto `path` when the block succeeds and removed when it raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{secrets.token_hex(3)}.partial{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)
