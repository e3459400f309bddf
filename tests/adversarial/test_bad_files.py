"""Files that are there but are not what their names say, and settings that name nothing: each is one line that
names the file or the setting, exit 2, never an internal error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hostile import cli


def _write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _shards_with_sizes(tmp: Path, sizes: str) -> list[str]:
    _write(tmp / "shards" / "sizes.json", sizes)
    _write(tmp / "shards" / "00000.tar", b"")
    return ["train", "--shards", str(tmp / "shards"), "--output", str(tmp / "run"), "--steps", "1"]


def _model_folder(tmp: Path, info: str) -> list[str]:
    _write(tmp / "model" / "model_info.json", info)
    return ["eval", "zeroshot", "--model", str(tmp / "model"), "--output", str(tmp / "out"), "--no-cache"]


def _alias_bomb() -> str:
    """A "billion laughs" of 1 KB: nine lists of nine aliases, 9**9 values once expanded, under a real key."""
    lines = ['  a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "anchors:\n" + "\n".join(lines) + "\ntrain:\n  batch_size: *a8\n"


CASES = {
    "params whose aliases expand past the bound": (
        lambda tmp: ["config", "--params", str(_write(tmp / "params.yaml", _alias_bomb()))],
        "its YAML aliases expand to over 100,000 values"),
    "params of 50 MB": (
        lambda tmp: ["config", "--params",
                     str(_write(tmp / "params.yaml", "train:\n  batch_size:\n" + "    - 1\n" * 6_000_000))],
        "holds over 1,048,576 characters, the most a configuration may have"),
    "params nested past the recursion limit": (
        lambda tmp: ["config", "--params",
                     str(_write(tmp / "params.yaml", "train:\n  x: " + "[" * 50_000 + "]" * 50_000))],
        "nests deeper than Python's recursion limit"),
    "a promotion floor on a metric the suite does not write": (
        lambda tmp: ["config", "--set", "promote.min_first={suite.zeroshot_acc9: 0.1}"],
        "promote.min_first.suite.zeroshot_acc9: 'suite.zeroshot_acc9' names no aggregate of eval.aggregates"),
    "a NaN promotion floor": (
        lambda tmp: ["config", "--set", "promote.min_first={suite.retrieval_recall@5: .nan}"],
        "promote.min_first.suite.retrieval_recall@5: Input should be a finite number"),
    "params that are not text": (
        lambda tmp: ["config", "--params", str(_write(tmp / "params.yaml", os.urandom(64) + b"\xff"))],
        "is not UTF-8 text"),
    "params that are a list": (
        lambda tmp: ["config", "--params", str(_write(tmp / "params.yaml", "- a\n- b\n"))],
        "must hold a mapping of sections"),
    "sizes.json with counts that are not numbers": (
        lambda tmp: _shards_with_sizes(tmp, '{"00000.tar": "many"}'), "must map shard names to sample counts"),
    "sizes.json that lists nothing": (lambda tmp: _shards_with_sizes(tmp, "{}"), "must map shard names"),
    "model_info.json without its keys": (
        lambda tmp: _model_folder(tmp, json.dumps({"architecture": "cloob-tiny"})),
        "does not describe an exported model: no inv_tau"),
    "a captions CSV without an image column": (
        lambda tmp: ["eval", "retrieval", "--data",
                     str(_write(tmp / "pairs.csv", "url,caption\nhttp://a/1.jpg,a cat\n")), "--output",
                     str(tmp / "out"), "--architecture", "cloob-tiny", "--weights", str(tmp / "w.pt")],
        "needs the columns image,caption"),
    "an unknown architecture": (
        lambda tmp: ["eval", "zeroshot", "--architecture", "resnet-9000", "--weights", str(tmp / "w.pt"),
                     "--output", str(tmp / "out")], "unknown architecture 'resnet-9000'"),
    "a device that does not exist": (
        lambda tmp: ["eval", "zeroshot", "--architecture", "cloob-tiny", "--weights", str(tmp / "w.pt"),
                     "--device", "cuda:7", "--output", str(tmp / "out")],
        "--device is cuda:7, but CUDA is unusable here"),
    "a device that is not one": (
        lambda tmp: ["eval", "zeroshot", "--architecture", "cloob-tiny", "--weights", str(tmp / "w.pt"),
                     "--device", "banana", "--output", str(tmp / "out")], "is not a device"),
    "a metrics file that is a list": (
        lambda tmp: ["eval", "summary", "--metrics", str(_write(tmp / "metrics.json", "[1, 2]"))],
        "is not a report's metrics.json"),
    "a compared run that is not a report": (
        lambda tmp: ["eval", "compare", "--run", "a=" + str(_write(tmp / "metrics.json", '{"x": 1}')), "--output",
                     str(tmp / "cmp.md")], "is not a report's metrics.json"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_file_or_setting_is_one_line(capsys, tmp_path, weights, case):
    build, expected = CASES[case]
    (tmp_path / "w.pt").write_bytes(weights.read_bytes())
    done = cli(capsys, *build(tmp_path))
    line = done.error_line()
    assert done.code == 2, line
    assert expected in line, line


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("AWS_MAX_ATTEMPTS", "abc", "AWS_MAX_ATTEMPTS='abc': the tries of each S3 request"),
    ("AWS_RETRY_MODE", "eager", "AWS_RETRY_MODE='eager': botocore's retry mode is one of legacy, standard, adaptive"),
])
def test_an_s3_retry_setting_botocore_cannot_read_is_named(capsys, monkeypatch, tmp_path, variable, value, expected):
    """botocore's own error was `invalid literal for int() with base 10: 'abc'`, naming neither the variable nor
    what it is for."""
    monkeypatch.setenv(variable, value)
    done = cli(capsys, "eval", "zeroshot", "--model", "s3://bucket/model", "--output", str(tmp_path / "out"))
    assert done.code == 2
    assert expected in done.error_line()
