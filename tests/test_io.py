"""Atomic writes publish files with the mode a plain open() gives them, and no module of ours touches the
process's umask to learn it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cloob_core.io import write_json, write_text


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_a_published_file_has_the_mode_the_umask_gives(tmp_path, umask):
    before = os.umask(umask)
    try:
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
        written = write_text(tmp_path / "atomic.txt", "x")
        json_file = write_json(tmp_path / "atomic.json", {"a": 1})
    finally:
        os.umask(before)
    expected = 0o666 & ~umask
    assert plain.stat().st_mode & 0o777 == expected
    assert written.stat().st_mode & 0o777 == expected and json_file.stat().st_mode & 0o777 == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atomic.json", "atomic.txt", "plain.txt"]  # no leftovers


def test_importing_the_package_never_changes_the_umask():
    """os.umask is the only way to read the umask, and it sets one while reading: a module that calls it at
    import races every thread that creates a file meanwhile."""
    script = ("import os\n"
              "def refuse(*args):\n"
              "    raise AssertionError('os.umask called at import')\n"
              "os.umask = refuse\n"
              "import cloob_core.io, cloob_core.storage, cloob_core.lease, cloob_core.cli\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
