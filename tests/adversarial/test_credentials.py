"""Credentials in manifest URLs never leave the process: user info and sensitive query values are in no file the
stages write (failure files, the samples' json inside the tars, the merged summary, the gate's report) and in no
line they print, while the fetch uses the full URL, and keys and the URL dedup are those of the full URLs."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from hostile import cli
from image_server import ImageServer

from cloob_core.config import SECRET_QUERY_PARAMS
from cloob_core.redact import Redactor

SECRETS = ("hunter2", "tok3n-value", "AKIAEXAMPLESIG", "s3cr3t-key", "letmein")
FAST = ["--set", "validation.min_success_ratio=0", "--set", "download.allow_private_network=true", "--set",
        "download.retries=0", "--set",
        "download.processes=1", "--set", "download.threads=4", "--set", "preprocess.image_size=32", "--set",
        "preprocess.shard_size=3", "--set", "download.url_deadline=5", "--no-progress"]


def every_text(folder: Path) -> str:
    """Every file under ``folder`` as text, the members of tars included."""
    texts = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        texts.append(path.read_bytes().decode("utf-8", "replace"))
        if path.suffix == ".tar":
            with tarfile.open(path) as tar:
                texts += [tar.extractfile(m).read().decode("utf-8", "replace") for m in tar.getmembers()]
    return "\n".join(texts)


def secret_urls(server: ImageServer) -> list[str]:
    port = server.port
    return [
        f"http://alice:hunter2@127.0.0.1:{port}/img/1.jpg",
        f"http://127.0.0.1:{port}/img/2.jpg?size=large&token=tok3n-value",
        f"http://127.0.0.1:{port}/img/3.jpg?X-Amz-Algorithm=AWS4&X-Amz-Signature=AKIAEXAMPLESIG",
        f"http://127.0.0.1:{port}/404?key=s3cr3t-key",
        f"http://bob:letmein@127.0.0.1:{port}/404?sig=AKIAEXAMPLESIG",
        f"http://127.0.0.1:{port}/img/4.jpg?token=tok3n-value",  # differs from the next only in its token
        f"http://127.0.0.1:{port}/img/4.jpg?token=other-tok3n-value",
        f"http://127.0.0.1:{port}/img/2.jpg?size=large&token=tok3n-value",  # the very URL of row 1 again
        f"http://127.0.0.1:{port}/stall?api_key=s3cr3t-key",
    ]


def test_download_records_carry_no_credentials_but_fetch_with_them(capsys, tmp_path):
    out = tmp_path / "shards"
    with ImageServer() as server:
        urls = secret_urls(server)
        (tmp_path / "m.csv").write_text("url,caption\n" + "".join(f"{u},photo {i}\n" for i, u in enumerate(urls)))
        done = cli(capsys, "data", "download", "--manifest", tmp_path / "m.csv", "--output", out, *FAST,
                   "--set", "download.read_timeout=1")
        seen = set(server.hits)
    assert done.code == 0, done.err
    assert "/img/2.jpg?size=large&token=tok3n-value" in seen and "/404?key=s3cr3t-key" in seen  # fetched in full
    written = every_text(out) + done.out + done.err
    assert not [secret for secret in SECRETS if secret in written]
    assert "token=REDACTED" in written and "X-Amz-Signature=REDACTED" in written and "size=large" in written
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    by_row = {failure["row"]: failure for failure in failures}
    assert by_row[7]["reason"] == "duplicate_url"  # the full URLs decide the dedup ...
    assert 5 not in by_row and by_row[6]["reason"] == "duplicate_content"  # ... a URL that differs only in its
    # token is fetched (and found to be the same image)
    assert by_row[3]["url"] == f"http://127.0.0.1:{server.port}/404?key=REDACTED"
    keys = set()
    for tar in sorted(out.glob("*.tar")):
        with tarfile.open(tar) as archive:
            for member in archive.getmembers():
                if member.name.endswith(".json"):
                    meta = json.load(io.BytesIO(archive.extractfile(member).read()))
                    keys.add(meta["key"])
                    assert "@" not in meta["url"]
    assert keys == {f"{row:09d}" for row in (0, 1, 2, 5)}  # keys from the rows, as without redaction


def test_the_data_gate_reports_no_credentials(capsys, tmp_path):
    urls = ["ftp://carol:hunter2@files.example/a.jpg?token=tok3n-value",  # breaks the URL pattern
            "https://cdn.example/b.jpg?X-Amz-Signature=AKIAEXAMPLESIG",
            "https://cdn.example/b.jpg?X-Amz-Signature=AKIAEXAMPLESIG"]  # not unique
    (tmp_path / "m.csv").write_text("url,caption\n" + "".join(f"{u},a photo\n" for u in urls))
    report = tmp_path / "gate"
    done = cli(capsys, "data", "validate", "--manifest", tmp_path / "m.csv", "--report", report)
    assert done.code == 1 and "FAIL" in done.out
    written = every_text(report) + done.out + done.err
    assert not [secret for secret in SECRETS if secret in written]
    assert "ftp://files.example/a.jpg?token=REDACTED" in written


@pytest.mark.parametrize(("url", "recorded"), [
    ("https://u:p@h.example/x.jpg", "https://h.example/x.jpg"),
    ("https://h.example/x.jpg?Token=a&tokenizer=b&x-amz-credential=c", "https://h.example/x.jpg?Token=REDACTED&"
     "tokenizer=b&x-amz-credential=REDACTED"),
    ("https://h.example/x.jpg?a=1&a=2", "https://h.example/x.jpg?a=1&a=2"),
    ("https://h.example/x%20y.jpg?key=1#frag", "https://h.example/x%20y.jpg?key=REDACTED#frag"),
    ("relative/path.jpg", "relative/path.jpg"),
])
def test_redaction_rules(url, recorded):
    assert Redactor.of(SECRET_QUERY_PARAMS).url(url) == recorded


def test_the_list_of_sensitive_parameters_is_configurable(capsys, tmp_path):
    out = tmp_path / "shards"
    with ImageServer() as server:
        url = f"http://127.0.0.1:{server.port}/404?session_hash=tok3n-value&token=visible-now"
        (tmp_path / "m.csv").write_text(f"url,caption\n{url},a photo\n")
        done = cli(capsys, "data", "download", "--manifest", tmp_path / "m.csv", "--output", out, *FAST,
                   "--set", 'download.redact_query_params=["session_hash"]')
    assert done.code == 0, done.err
    written = every_text(out)
    assert "tok3n-value" not in written and "session_hash=REDACTED" in written and "token=visible-now" in written
