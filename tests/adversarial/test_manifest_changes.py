"""No change to a manifest part goes unseen, and no part is left out without a word: a part rewritten with the same
size whose modification time is put back (``rsync -t``, ``cp -p``, ``touch -r``), and parts that are symbolic
links, to files or to folders."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hostile import cli

from cloob_core.data.run_manifest import RunManifest


def _part(path: Path, captions: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("url,caption\n" + "".join(f"http://example.com/{i}.jpg,{c}\n" for i, c in enumerate(captions)))
    return path


def _captions(location: Path) -> list[str]:
    manifest = RunManifest.open(str(location))
    return [row.caption for row in manifest.rows(list(range(len(manifest))))]


def _in_place(path: Path, text: str) -> None:
    with open(path, "r+") as handle:  # the same file (inode), rewritten
        handle.write(text)


def _replaced_by_rename(path: Path, text: str) -> None:  # rsync's default: a temporary file renamed over it
    temporary = path.with_name(".tmp-" + path.name)
    temporary.write_text(text)
    os.replace(temporary, path)


def _copied_preserving(path: Path, text: str) -> None:  # cp -p from elsewhere
    elsewhere = path.parent.parent / "elsewhere.csv"
    elsewhere.write_text(text)
    shutil.copy2(elsewhere, path)


@pytest.mark.parametrize("rewrite", [_in_place, _replaced_by_rename, _copied_preserving])
@pytest.mark.parametrize("layout", ["folder", "file"])
def test_a_same_size_rewrite_with_its_mtime_put_back_is_seen(capsys, tmp_path, rewrite, layout):
    source = tmp_path / "source"
    first = _part(source / "a.csv", ["cat one", "dog two"])
    second = _part(source / "b.csv", ["bird three"])
    given = source if layout == "folder" else second
    out = tmp_path / "manifest"
    assert cli(capsys, "data", "acquire", "--source", given, "--output", out).code == 0
    stat = os.stat(second)
    new_text = second.read_text().replace("bird three", "fish three")  # the same size
    rewrite(second, new_text)
    os.utime(second, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the modification time put back
    assert os.stat(second).st_size == stat.st_size and os.stat(second).st_mtime_ns == stat.st_mtime_ns
    done = cli(capsys, "data", "acquire", "--source", given, "--output", out)
    assert done.code == 0, done.err
    captions = _captions(out)
    assert "fish three" in captions and "bird three" not in captions
    if layout == "folder":  # the unchanged part is reused as it was
        assert "2 part(s), 1 unchanged" in done.out and first.exists()


def test_symlinked_parts_and_folders_are_followed_once(capsys, tmp_path, caplog):
    outside = tmp_path / "outside"
    _part(outside / "linked_file.csv", ["a", "b", "c"])
    _part(outside / "folder" / "p1.csv", ["d", "e", "f", "g"])
    source = tmp_path / "source"
    _part(source / "real.csv", ["h", "i", "j", "k", "l", "m", "n"])
    os.symlink(outside / "linked_file.csv", source / "linked.csv")
    os.symlink(outside / "folder", source / "linked_folder")
    os.symlink(source, source / "loop")  # a link back to the folder itself
    out = tmp_path / "manifest"
    done = cli(capsys, "data", "acquire", "--source", source, "--output", out)
    assert done.code == 0, done.err
    assert len(RunManifest.open(str(out))) == 14  # 7 + 3 + 4: nothing left out, nothing read twice
    assert "symbolic link loop" in caplog.text


def test_a_dangling_symlinked_part_is_one_line(capsys, tmp_path):
    source = tmp_path / "source"
    _part(source / "real.csv", ["a"])
    os.symlink(tmp_path / "gone.csv", source / "dangling.csv")
    done = cli(capsys, "data", "acquire", "--source", source, "--output", tmp_path / "manifest")
    line = done.error_line()
    assert done.code == 2 and "dangling.csv is a symbolic link to" in line and "which does not exist" in line
    assert not (tmp_path / "manifest" / "_manifest.json").exists()
