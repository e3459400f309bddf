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
import tempfile
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from cloob_core import storage
from cloob_core.config import EngineConfig

if TYPE_CHECKING:
    import duckdb


@contextlib.contextmanager
def connect(settings: EngineConfig, locations: Sequence[str] = ()) -> Iterator[duckdb.DuckDBPyConnection]:
    """An in-memory DuckDB under ``settings`` (memory limit, threads, spill folder), able to read ``locations``."""
    import duckdb

    with contextlib.ExitStack() as stack:
        spill = settings.spill_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="cloob-duckdb-"))
        options = {"memory_limit": settings.memory_limit, "temp_directory": spill,
                   "preserve_insertion_order": False, "enable_external_access": True}
        if settings.threads:
            options["threads"] = settings.threads
        connection = duckdb.connect(":memory:", config=options)
        stack.callback(connection.close)
        if any(storage.is_s3(location) for location in locations):
            connection.register_filesystem(storage.s3_filesystem())
        yield connection


def quoted(identifier: str) -> str:
    """A column name as a SQL identifier (a manifest's columns are the user's)."""
    return '"' + identifier.replace('"', '""') + '"'
