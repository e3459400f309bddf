"""Atomic writes: a reader (or a resumed run) sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the file the mode a plain open() would
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    with atomic_path(path) as tmp:
        write(tmp)
    return Path(path)


def write_torch(path: str | Path, data: Any, before_publish: Callable[[Path], Any] | None = None) -> Path:
    """``torch.save`` atomically, through a file handle: the archive inside is then named "archive", not after
    the temporary file, so the same tensors always give the same bytes (a reproducible output, a stable id).
    ``before_publish`` sees the finished temporary file before it takes the name (to record its checksum)."""
    import torch  # here, not at the top: the data stages use this module without torch

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            torch.save(data, handle)
        if before_publish is not None:
            before_publish(tmp)

    return atomic_write(path, write)


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def json_bytes(data: Any, **options: Any) -> bytes:
    """The project's JSON file format: indented, keys sorted, newline-terminated (stable bytes for resumes)."""
    return (json.dumps(data, indent=2, sort_keys=True, **options) + "\n").encode()


def write_json(path: str | Path, data: Any) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(json_bytes(data)))


def read_json_or(path: str | Path, default: Any) -> Any:
    """The JSON at ``path``, or ``default`` when there is no such file yet."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default
