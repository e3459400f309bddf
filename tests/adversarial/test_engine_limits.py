"""The engine's limits are the user's settings: bad ones are refused with the configuration (exit 2, naming the
key), and running out of the memory or the spill space they give is one line naming the setting to raise and the
amount that was needed, not an internal error."""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile import cli


def _manifest(path: Path, rows: int) -> Path:
    with open(path, "w") as handle:
        handle.write("url,caption\n")
        for i in range(rows):
            handle.write(f"http://example.com/a-rather-long-path/to/image/number/{i:09d}.jpg,caption {i}\n")
    return path


@pytest.mark.parametrize(("setting", "value"), [
    ("engine.memory_limit", "abc"), ("engine.memory_limit", "-5GB"), ("engine.memory_limit", "0MB"),
    ("engine.memory_limit", "512"), ("engine.memory_limit", "150%"), ("engine.spill_dir", "s3://bucket/spill"),
    ("engine.threads", "-1"),
])
def test_a_bad_engine_setting_is_refused_with_the_configuration(capsys, tmp_path, setting, value):
    source = _manifest(tmp_path / "m.csv", 10)
    done = cli(capsys, "data", "acquire", "--source", source, "--output", tmp_path / "out", "--set",
               f"{setting}={value}")
    line = done.error_line()
    assert done.code == 2 and setting in line, line
    assert not (tmp_path / "out").exists()  # refused before any work


def test_a_memory_limit_too_small_for_the_step_names_the_setting_and_the_need(capsys, tmp_path):
    source = _manifest(tmp_path / "m.csv", 20_000)
    out = tmp_path / "out"
    done = cli(capsys, "data", "acquire", "--source", source, "--output", out, "--set", "engine.memory_limit=1MB")
    line = done.error_line()
    assert done.code == 2 and "engine.memory_limit (1MB) is too small" in line and "needed" in line, line
    assert "raise engine.memory_limit" in line
    assert not (out / "_manifest.json").exists()  # nothing published


def test_a_full_spill_folder_names_the_setting_and_the_need(capsys, tmp_path, small_disk):
    spill = small_disk(256 * 1024)
    source = _manifest(tmp_path / "m.csv", 400_000)
    out = tmp_path / "out"
    done = cli(capsys, "data", "acquire", "--source", source, "--output", out, "--set", "engine.memory_limit=12MB",
               "--set", "engine.threads=1", "--set", f"engine.spill_dir={spill}")
    line = done.error_line()
    assert done.code == 2 and f"engine.spill_dir ({spill}) ran out of space" in line and "needed" in line, line
    assert not (out / "_manifest.json").exists()
