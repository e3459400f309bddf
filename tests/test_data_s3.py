"""S3 in and out through boto3, against a real S3-compatible server (moto) on 127.0.0.1."""

from __future__ import annotations

import io
import json

import pandas as pd
from image_server import ImageServer

from cloob_core import storage
from cloob_core.config import load_config
from cloob_core.data.download import download
from cloob_core.data.validate import run_gate


def test_manifest_and_shards_on_s3_then_read_back(s3_bucket, read_shards):
    with ImageServer() as server:
        frame = pd.DataFrame({
            "URL": [server.url(f"/img/{i}.jpg") for i in range(9)] + [server.url("/404")],
            "TEXT": [f"photo {i}" for i in range(9)] + ["gone"],
            "label": list(range(10)),
        })
        buffer = io.BytesIO()
        frame.to_parquet(buffer)
        storage.write_bytes(f"s3://{s3_bucket}/manifests/m.parquet", buffer.getvalue())
        config = load_config(overrides=["download.allow_private_network=true", "download.url_col=URL",
                                        "download.caption_col=TEXT", "preprocess.image_size=32",
                                        "preprocess.shard_size=4", "download.processes=2"])
        output = f"s3://{s3_bucket}/shards/v1"
        result = download(f"s3://{s3_bucket}/manifests/m.parquet", output, config, progress=False)
    assert result.summary.stats["successes"] == 9
    names = storage.list_names(output)
    assert {"00000.tar", "00001.tar", "00002.tar", "sizes.json", "stats.json", "failures.jsonl"} <= set(names)
    assert json.loads(storage.read_bytes(f"{output}/sizes.json")) == {"00000.tar": 4, "00001.tar": 4,
                                                                      "00002.tar": 1}
    # a re-run against S3 finds the finished shards
    again = download(f"s3://{s3_bucket}/manifests/m.parquet", output, config, progress=False)
    assert again.shards_done == 0 and again.shards_skipped == 3

    samples = read_shards(output)
    assert sorted(meta["label"] for *_, meta in samples) == list(range(9))
    assert all(min(image.shape[:2]) == 32 for image, *_ in samples)

    report = run_gate(config, shards=output, report_dir=f"s3://{s3_bucket}/reports/v1")
    assert report.passed, report.text()
    assert json.loads(storage.read_bytes(f"s3://{s3_bucket}/reports/v1/gx_results.json"))["shards"]["success"]


def test_s3_problems_get_a_clear_message(s3_server, tmp_path, capsys):
    from cloob_core.cli import main

    code = main(["data", "download", "--manifest", "s3://no-such-bucket-here/m.csv", "--output", str(tmp_path)])
    assert code == 2 and "NoSuchBucket" in capsys.readouterr().err
