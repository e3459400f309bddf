"""The data stage's parts on their own: manifest reader, address policy, opt-out parsing, image checks."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pandas as pd
import pytest
from image_server import bomb_png, photo_bytes
from PIL import Image

from cloob_core.config import CloobConfig, ConfigError, load_config
from cloob_core.data.acquire import acquire_into
from cloob_core.data.fetch import address_refusal, opted_out
from cloob_core.data.imaging import caption_refusal, process_image
from cloob_core.data.manifest import ManifestError, Partition, list_parts, read_batches, read_manifest
from cloob_core.data.run_manifest import RunManifest


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.7", "private"),
        ("172.16.5.4", "private"), ("169.254.10.10", "link-local"), ("169.254.169.254", "metadata"),
        ("fd00:ec2::254", "metadata"), ("::ffff:127.0.0.1", "loopback"), ("0.0.0.0", "unspecified"),
        ("100.64.1.1", "non-global"), ("224.0.0.1", "multicast"), ("fe80::1", "link-local"),
        ("8.8.8.8", None), ("2606:4700:4700::1111", None), ("151.101.1.69", None),
    ],
)
def test_address_policy(address, refused):
    why = address_refusal(address)
    assert (why is None) if refused is None else (refused in why)


def test_metadata_stays_refused_when_private_networks_are_allowed():
    assert address_refusal("127.0.0.1", allow_private=True) is None
    assert "metadata" in address_refusal("169.254.169.254", allow_private=True)


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        ("::ffff:169.254.169.254", "metadata"),  # IPv4-mapped
        ("64:ff9b::a9fe:a9fe", "metadata"), ("64:ff9b:1::a9fe:a9fe", "metadata"),  # NAT64, well-known and local
        ("2002:a9fe:a9fe::1", "metadata"),  # 6to4
        ("::a9fe:a9fe", "metadata"),  # IPv4-compatible
        ("::ffff:0:a9fe:a9fe", "metadata"),  # IPv4-translated (SIIT)
        ("fe80::5efe:a9fe:a9fe", "metadata"), ("2001:db8::200:5efe:a9fe:a9fe", "metadata"),  # ISATAP
        ("2001:0:4136:e378:8000:63bf:5601:5601", "metadata"),  # Teredo, client 169.254.169.254 obfuscated
        ("64:ff9b::7f00:1", "loopback"), ("2002:c0a8:1::1", "private"), ("::10.0.0.1", "private"),
        ("64:ff9b::808:808", None),  # NAT64 of 8.8.8.8: public
    ],
)
def test_every_embedding_of_an_ipv4_address_is_unwrapped(address, refused):
    why = address_refusal(address)
    assert (why is None) if refused is None else (refused in why), why
    if refused == "metadata":
        assert "metadata" in address_refusal(address, allow_private=True)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (["noai"], True), (["noindex, nofollow"], True), (["NoImageAI"], True), (["noimageindex"], True),
        (["nofollow"], False), ([], False), (["otherbot: noai"], False), (["cloob-pipelines: noai"], True),
        (["*: noindex"], True), (["googlebot: noindex", "max-snippet: 20"], False), (["all", "noai"], True),
    ],
)
def test_x_robots_tag_opt_out(values, expected):
    assert opted_out(values) is expected


CC3M_TSV = (
    "a very typical bus station\thttp://example.com/a.jpg\n"
    "sierra view in the morning\thttps://example.com/b.jpg\n"
)


@pytest.mark.parametrize("fmt", ["csv", "tsv", "parquet", "jsonl", "csv.gz"])
def test_manifest_formats_agree(tmp_path, fmt):
    frame = pd.DataFrame({"url": ["http://x/1.jpg", "http://x/2.jpg"], "caption": ["one", "two, with comma"],
                          "score": [0.5, 0.25]})
    path = tmp_path / f"m.{fmt}"
    if fmt == "csv":
        frame.to_csv(path, index=False)
    elif fmt == "csv.gz":
        path.write_bytes(gzip.compress(frame.to_csv(index=False).encode()))
    elif fmt == "tsv":
        frame.to_csv(path, sep="\t", index=False)
    elif fmt == "parquet":
        frame.to_parquet(path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in frame.to_dict("records")))
    manifest = run_manifest(path)
    rows = manifest.rows([0, 1])
    assert [r.url for r in rows] == ["http://x/1.jpg", "http://x/2.jpg"]
    assert rows[1].caption == "two, with comma" and rows[1].key == "000000001"
    assert float(rows[0].extra["score"]) == 0.5


def test_headerless_cc3m_tsv_is_detected(tmp_path):
    path = tmp_path / "Train_GCC-training.tsv"
    path.write_text(CC3M_TSV)
    frame = read_manifest(str(path))
    assert list(frame["url"]) == ["http://example.com/a.jpg", "https://example.com/b.jpg"]
    assert list(frame["caption"]) == ["a very typical bus station", "sierra view in the morning"]


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        ("link,text\nhttp://a/b.jpg,x\n", "m.csv", r"no column\(s\)"),
        ("\x00\x01garbage", "m.parquet", "not valid parquet"),
        ("{not json\n", "m.jsonl", "not valid jsonl"),
        ("url,caption\n", "m.xlsx", "cannot tell the format"),
    ],
)
def test_bad_manifests_get_clear_errors(tmp_path, content, name, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ManifestError, match=message):
        read_manifest(str(path))


def test_missing_manifest(tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        read_manifest(str(tmp_path / "nope.csv"))


def run_manifest(path: Path) -> RunManifest:
    """``path`` acquired into a run manifest beside it."""
    return acquire_into(str(path), str(path.parent / f"{path.name}.acquired"), CloobConfig())


def test_each_repeated_url_points_at_its_first_row(tmp_path):
    path = tmp_path / "m.csv"
    pd.DataFrame({"url": ["a", "b", "a", "c", "b"], "caption": list("vwxyz")}).to_csv(path, index=False)
    manifest = run_manifest(path)
    assert manifest.duplicate_rows == 2
    assert manifest.duplicates_between(0, 5) == {2: 0, 4: 1} and manifest.duplicates_between(3, 5) == {4: 1}


def test_partition_parsing_and_ownership():
    part = Partition.parse("1/3")
    assert part.shards(7) == range(2, 4)  # contiguous ranges that tile the shards in order
    assert [list(Partition(i, 3).shards(7)) for i in range(3)] == [[0, 1], [2, 3], [4, 5, 6]]
    assert [len(Partition(i, 4).shards(2)) for i in range(4)] == [0, 1, 0, 1]  # more partitions than shards
    for bad in ("3/3", "1", "a/b", "0/0"):
        with pytest.raises(ManifestError):
            Partition.parse(bad)


def _config(**preprocess):
    return load_config(overrides=[f"preprocess.{k}={json.dumps(v)}" for k, v in preprocess.items()]).preprocess


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("keep_ratio", (85, 64)), ("center_crop", (64, 64)), ("border", (64, 64)), ("no", (213, 161))],
)
def test_resize_modes(mode, expected):
    result = process_image(photo_bytes(1), _config(image_size=64, resize_mode=mode))
    assert (result.width, result.height) == expected
    assert (result.original_width, result.original_height) == (213, 161)
    image = Image.open(io.BytesIO(result.jpeg))
    assert image.size == expected and image.mode == "RGB"
    if mode == "border":  # the long side fits, the short side is padded with black bars
        pixels = image.convert("L")
        assert pixels.getpixel((32, 0)) < 10 and pixels.getpixel((32, 63)) < 10


def test_by_default_no_image_is_enlarged_and_no_side_passes_the_bound():
    small = _config(image_size=1000, max_side=None)
    result = process_image(photo_bytes(1), small)
    assert (result.width, result.height) == (213, 161)  # the default: never enlarge
    assert process_image(photo_bytes(1), _config(image_size=1000, resize_only_if_bigger=False, max_side=None)) \
        .height == 1000
    # A 128 x 1,728 strip: enlarged to 256 it would be 3,456 long; it is neither enlarged nor longer than the bound.
    strip = io.BytesIO()
    Image.new("RGB", (128, 1728), (10, 200, 40)).save(strip, format="PNG")
    for settings, expected in (({}, (76, 1024)), ({"resize_only_if_bigger": False}, (76, 1024)),
                               ({"max_side": None}, (128, 1728)), ({"max_side": 4096, "resize_only_if_bigger": False},
                                                                  (256, 3456)), ({"resize_mode": "no"}, (76, 1024))):
        result = process_image(strip.getvalue(), _config(image_size=256, **settings))
        assert (result.width, result.height) == expected, settings
    large = _config(image_size=64, resize_mode="no", max_side=100)
    assert max(process_image(photo_bytes(1), large).width, process_image(photo_bytes(1), large).height) == 100
    with pytest.raises(ConfigError, match=r"preprocess\.max_side 100 is below preprocess\.image_size 256"):
        load_config(overrides=["preprocess.max_side=100"])


def test_filters_and_guards():
    assert process_image(photo_bytes(1), _config(min_image_side=200)).reason == "too_small"
    assert process_image(photo_bytes(1), _config(max_aspect_ratio=1.2)).reason == "aspect_ratio"
    assert process_image(bomb_png(), _config()).reason == "decompression_bomb"
    assert process_image(b"GIF89a not really", _config()).reason == "decode_error"
    truncated = photo_bytes(2)[:-2000]
    assert process_image(truncated, _config()).reason == "decode_error"


def test_exif_rotation_and_alpha_become_upright_rgb():
    image = Image.open(io.BytesIO(photo_bytes(1)))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° on display
    out = io.BytesIO()
    image.save(out, format="JPEG", exif=exif)
    result = process_image(out.getvalue(), _config(resize_mode="no"))
    assert (result.width, result.height) == (161, 213)
    rgba = Image.new("RGBA", (40, 40), (255, 0, 0, 0))
    out = io.BytesIO()
    rgba.save(out, format="PNG")
    flat = Image.open(io.BytesIO(process_image(out.getvalue(), _config(resize_mode="no")).jpeg))
    assert min(flat.getpixel((20, 20))) > 245  # transparent → white background


@pytest.mark.parametrize(
    ("caption", "reason"),
    [("", "empty_caption"), ("   ", "empty_caption"), ("ab", "caption_too_short"), ("x" * 31, "caption_too_long"),
     ("a fine caption", None)],
)
def test_caption_filters(caption, reason):
    refusal = caption_refusal(caption, _config(min_caption_chars=3, max_caption_chars=30))
    assert (refusal[0] if refusal else None) == reason


def test_a_stuck_dns_lookup_is_bounded_by_the_connect_timeout(monkeypatch):
    import socket
    import time

    from cloob_core.config import DownloadConfig
    from cloob_core.data.fetch import Fetcher, FetchPolicy

    def stuck(*args, **kwargs):
        time.sleep(30)
        raise socket.gaierror("too late")

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    started = time.monotonic()
    policy = FetchPolicy.from_config(DownloadConfig(connect_timeout=0.3, retries=0))
    result = Fetcher(policy).fetch("http://images.example/x.jpg")
    assert result.reason == "dns_error" and "longer than 0.3 s" in result.detail
    assert time.monotonic() - started < 15  # far below the 30 s the lookup hangs, with room for a loaded machine


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_several_captions_per_image_travel_from_the_manifest_to_the_loader(tmp_path, fmt):
    """A `captions` column (lists in JSONL / parquet, JSON arrays in CSV) reaches the sample's metadata, where
    the training loader finds the text views."""
    from cloob_core.training.streams import sample_captions

    frame = pd.DataFrame({"url": ["http://a/1.jpg"], "caption": ["a red bus"],
                          "captions": [["a red bus", "a bus on a street", "public transport"]]})
    path = tmp_path / f"m.{fmt}"
    if fmt == "csv":
        frame.assign(captions=frame.captions.map(json.dumps)).to_csv(path, index=False)
    elif fmt == "jsonl":
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_parquet(path)
    (row,) = run_manifest(path).rows([0])
    meta = json.dumps({**row.extra, "caption": row.caption})  # as the worker writes the shard's .json
    sample = {"txt": row.caption.encode(), "json": meta.encode()}
    assert sample_captions(sample) == ["a red bus", "a bus on a street", "public transport"]


def test_a_folder_of_parts_in_any_format_is_read_in_path_order(tmp_path):
    folder = tmp_path / "crawl"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.csv").write_text("url,caption\nhttp://x/1.jpg,one\n")
    (folder / "sub" / "b.jsonl").write_text('{"url": "http://x/2.jpg", "caption": "two"}\n')
    (folder / "c.tsv.gz").write_bytes(gzip.compress(b"url\tcaption\nhttp://x/3.jpg\tthree\n"))
    for skipped in ("_SUCCESS", ".half-written.csv", "README.md", "_logs/x.csv"):
        (folder / skipped).parent.mkdir(exist_ok=True)
        (folder / skipped).write_text("not a part")
    parts = list_parts(str(folder))
    assert [Path(p.location).relative_to(folder).as_posix() for p in parts] == ["a.csv", "c.tsv.gz", "sub/b.jsonl"]
    assert [p.kind for p in parts] == ["csv", "tsv", "jsonl"] and parts[1].compression == "gzip"
    assert list(read_manifest(str(folder))["caption"]) == ["one", "three", "two"]
    manifest = run_manifest(folder)
    assert [row.url for row in manifest.rows([0, 1, 2])] == ["http://x/1.jpg", "http://x/3.jpg", "http://x/2.jpg"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("no parts here")
    with pytest.raises(ManifestError, match="holds no manifest parts"):
        list_parts(str(tmp_path / "notes"))


def test_a_part_is_read_in_batches_in_order(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("url,caption\n" + "".join(f"http://x/{i}.jpg,c{i}\n" for i in range(10)))
    (part,) = list_parts(str(path))
    batches = list(read_batches(part, batch_rows=3))
    assert [b.num_rows for b in batches] == [3, 3, 3, 1]
    assert [c for b in batches for c in b.column("caption").to_pylist()] == [f"c{i}" for i in range(10)]


def test_columns_are_one_type_in_a_part_and_one_appearing_late_is_named(tmp_path):
    import pyarrow as pa

    from cloob_core.data.run_manifest import PartSource, write_run_manifest

    first = pa.table({"url": ["http://x/1.jpg"], "caption": ["a"], "note": pa.nulls(1)})  # no type known yet
    later = pa.table({"url": ["http://x/2.jpg"], "caption": ["b"], "note": ["written"]})
    manifest = write_run_manifest([PartSource("p", "1", lambda: iter([first, later]))], str(tmp_path / "ok"), "url",
                                  "caption", 1024, CloobConfig().engine)
    assert [row.extra["note"] for row in manifest.rows([0, 1])] == [None, "written"]
    extra = pa.table({"url": ["http://x/3.jpg"], "caption": ["c"], "note": ["x"], "surprise": [1]})
    with pytest.raises(ManifestError, match=r"column\(s\) \['surprise'\] appear only after the first rows"):
        write_run_manifest([PartSource("p", "1", lambda: iter([later, extra]))], str(tmp_path / "bad"), "url",
                           "caption", 1024, CloobConfig().engine)


def _tarfile_bytes(samples: list[dict]) -> bytes:
    """What the writer wrote with tarfile before it built headers itself: the bytes it must keep writing."""
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
        for record in samples:
            for suffix in sorted(k for k in record if k != "__key__"):
                info = tarfile.TarInfo(f"{record['__key__']}.{suffix}")
                info.size, info.mtime, info.mode = len(record[suffix]), 0, 0o444
                info.uname = info.gname = "cloob"
                tar.addfile(info, io.BytesIO(record[suffix]))
    return out.getvalue()


@pytest.mark.parametrize("count", [0, 1, 7, 40])
def test_the_shard_writer_writes_the_bytes_tarfile_writes(count):
    import random

    from cloob_core.data.writer import ShardWriter

    rng = random.Random(count)
    keys = ["000000001", "s0000042", "x" * 90, "kéy-ünïcode", "a/b" * 40, "\udcff-surrogate"]  # a/b…: USTAR's prefix
    samples = [{"__key__": keys[i % len(keys)] + f"{i}", "jpg": rng.randbytes(rng.choice([0, 1, 511, 512, 513,
                                                                                          rng.randrange(90_000)])),
                "txt": rng.randbytes(rng.randrange(40)), "json": b"{}"} for i in range(count)]
    out = io.BytesIO()
    with ShardWriter(out) as writer:
        for record in samples:
            writer.write_sample(record)
    assert out.getvalue() == _tarfile_bytes(samples)
    assert len(out.getvalue()) % (20 * 512) == 0
