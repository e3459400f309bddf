"""The out-of-core engine for the manifest-wide work (URL duplicates, the gate's exact aggregates, its sample):
DuckDB, which streams parquet folders column by column, keeps to a memory limit and spills to disk beyond it.

Why DuckDB and not Spark: every manifest-wide step here is one aggregate or one join over two or three columns,
which one pod finishes in minutes for 10^9 rows (the scale benchmark measures it); Spark would add a JVM, a driver
and an operator to the cluster for no step that needs more than one machine. The per-row work (fetching, decoding)
is what spans machines, and it needs no shuffle: the Argo fan-out hands each pod a range of shards.
S3 objects are read through fsspec (s3fs): DuckDB's own httpfs extension is downloaded at run time.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from cloob_core import scratch, storage
from cloob_core.config import EngineConfig
from cloob_core.errors import StageError

if TYPE_CHECKING:
    import duckdb


class EngineLimit(StageError):
    """The engine ran out of the memory or the spill space the configuration gives it: the user's limit."""


_NEEDED = re.compile(r"of size ([\d.]+ \w+) \(([\d.]+ \w+)/([\d.]+ \w+) used\)")


def _limit_reached(err: Exception, settings: EngineConfig, spill: str) -> EngineLimit | None:
    """DuckDB's out-of-memory or out-of-spill-space as one line naming the setting to raise and the amount that
    was needed; None for any other error."""
    text = str(err)
    found = _NEEDED.search(text)
    needed = f"{found.group(1)} more, with {found.group(2)} of {found.group(3)} in use" if found else "more"
    if "failed to offload" in text:
        return EngineLimit(f"engine.spill_dir ({spill}) ran out of space: the engine needed {needed} to spill; "
                           "give engine.spill_dir a folder with more free space (about the size of the manifest's "
                           "URL column), or raise engine.memory_limit")
    if type(err).__name__ == "OutOfMemoryException":
        return EngineLimit(f"engine.memory_limit ({settings.memory_limit}) is too small for this step: the engine "
                           f"needed {needed}; raise engine.memory_limit (or lower engine.threads)")
    if type(err).__name__ == "IOException" and (settings.spill_dir and settings.spill_dir in text):
        return EngineLimit(f"engine.spill_dir ({settings.spill_dir}) cannot be written: {text.splitlines()[0]}")
    return None


@contextlib.contextmanager
def connect(settings: EngineConfig, locations: Sequence[str] = ()) -> Iterator[duckdb.DuckDBPyConnection]:
    """An in-memory DuckDB under ``settings`` (memory limit, threads, spill folder), able to read ``locations``.
    Running out of the memory limit or of spill space is :class:`EngineLimit`."""
    import duckdb

    with contextlib.ExitStack() as stack:
        spill = settings.spill_dir or str(stack.enter_context(scratch.folder("cloob-duckdb")))
        options = {"memory_limit": settings.memory_limit, "temp_directory": spill,
                   "preserve_insertion_order": False, "enable_external_access": True}
        if settings.threads:
            options["threads"] = settings.threads
        connection = duckdb.connect(":memory:", config=options)
        stack.callback(connection.close)
        if any(storage.is_s3(location) for location in locations):
            connection.register_filesystem(storage.s3_filesystem())
        try:
            yield connection
        except duckdb.Error as err:
            limit = _limit_reached(err, settings, spill)
            if limit is None:
                raise
            raise limit from None


def quoted(identifier: str) -> str:
    """A column name as a SQL identifier (a manifest's columns are the user's)."""
    return '"' + identifier.replace('"', '""') + '"'
