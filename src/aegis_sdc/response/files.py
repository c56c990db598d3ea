"""Files the library writes for others to trust: whole or not at all, never through a planted link."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """`write(file)` into a fresh temporary file beside `path` (`O_CREAT | O_EXCL | O_NOFOLLOW`, a name
    nobody can predict), fsync it, rename it over `path` and fsync the directory: a reader sees the
    old file or the new one, never a torn one, and a process killed meanwhile leaves at most the
    temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
