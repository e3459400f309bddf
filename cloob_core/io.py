"""Atomic writes: a reader (or a resumed run) sees the old file or the new one, never half of one. And reads of
the project's own formats (JSON, tensors) that name the file when it is not what it should be."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from cloob_core.errors import StageError, no_space


def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    """The hex digest of a file's bytes, read in blocks (weights files are large)."""
    digest = hashlib.new(algorithm, usedforsecurity=False)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def json_digest(value: Any) -> str:
    """SHA-256 of a JSON value in canonical form (what identifies settings and listings)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class DiskFull(StageError):
    """A write ran out of space (or quota): the user's to fix, so one line naming the file, never a traceback.
    What was being written is not published; earlier outputs (the last good checkpoint) stay."""


@contextmanager
def naming_full_disk(path: str | Path) -> Iterator[None]:
    """Turn running out of space inside the block into :class:`DiskFull` naming ``path``."""
    try:
        yield
    except OSError as err:
        if not no_space(err):
            raise
        raise DiskFull(f"no space left on device writing {path}") from None


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed over ``path``. Running out
    of space is :class:`DiskFull` naming ``path``, and leaves ``path`` as it was."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder: give a file name to write")
    with naming_full_disk(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _new_temporary(path)
        try:
            yield tmp
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{12}\.tmp$")


def remove_temporaries(folder: str | Path, owned: Callable[[str], bool]) -> None:
    """Remove the temporaries of :func:`atomic_path` that writes killed mid-way left in the local ``folder``, for
    the files whose names ``owned`` accepts. The caller holds the folder's lease: no live write of those files."""
    if not Path(folder).is_dir():
        return
    for path in Path(folder).iterdir():
        found = _TEMPORARY.match(path.name)
        if found and owned(found.group("name")):
            path.unlink(missing_ok=True)


def _new_temporary(path: Path) -> Path:
    """An empty file of a fresh name beside ``path``, created with mode 0666 so the kernel applies the umask:
    the published file has the mode a plain ``open()`` would give it (``mkstemp`` would make it 0600)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


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
            recording = _RecordingWriter(handle)
            try:
                torch.save(data, recording)
            except RuntimeError:
                # torch's zip writer reports a failed write as "unexpected pos …"; the OSError behind it says why
                if recording.error is not None:
                    raise recording.error from None
                raise
        if before_publish is not None:
            before_publish(tmp)

    return atomic_write(path, write)


def write_safetensors(path: str | Path, tensors: dict[str, Any]) -> Path:
    """Tensors in the safetensors format (no pickle at all), atomically; the same tensors give the same bytes."""
    from safetensors.torch import save

    data = save({name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()})
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def read_safetensors(path: str | Path) -> dict[str, Any]:
    """A safetensors file's tensors; a damaged file is one line naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return load_file(path)  # mapped, not read into memory first: weights files are large
    except (SafetensorError, ValueError) as err:
        raise UnreadableFile(f"{path} cannot be read as safetensors: {str(err).splitlines()[0][:200]}") from None


class _RecordingWriter:
    """A binary file handle that keeps the ``OSError`` of a failed write, which torch.save would swallow."""

    def __init__(self, handle: IO[bytes]) -> None:
        self._handle = handle
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self._handle.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self._handle.flush()


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def json_bytes(data: Any, **options: Any) -> bytes:
    """The project's JSON file format: indented, keys sorted, newline-terminated (stable bytes for resumes)."""
    return (json.dumps(data, indent=2, sort_keys=True, **options) + "\n").encode()


def write_json(path: str | Path, data: Any) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(json_bytes(data)))


class UnreadableFile(StageError, ValueError):
    """A file is there but does not hold what it should (not JSON, not a tensor archive, a pickle with code)."""


def parse_json(data: bytes | str, source: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise UnreadableFile(f"{source} is not valid JSON ({err})") from None


def read_torch(source: str | Path | IO[bytes], name: str) -> Any:
    """``torch.load`` as data only (``weights_only``: tensors and plain containers, never code); a refused
    pickle or a broken archive is one line naming ``name``, not torch's advice to turn the safety off."""
    import torch

    try:
        with warnings.catch_warnings():  # torch's notes on pickle protocols are not the user's concern
            warnings.simplefilter("ignore")
            return torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:
        raise UnreadableFile(f"{name} cannot be read as PyTorch tensors: {_torch_load_problem(err)}") from None


def _torch_load_problem(err: Exception) -> str:
    text = str(err)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return f"it holds a pickled {found.group(1)}, which is never unpickled (a pickle can run code)"
    if "Weights only load failed" in text:
        return "it is not a tensor file written by torch.save (or holds objects that are never unpickled)"
    if "zip archive" in text or "central directory" in text:
        return "the archive is damaged or incomplete"
    return (text.strip().splitlines() or [type(err).__name__])[0][:200]
