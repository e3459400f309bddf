"""The storage interface gives the same answers on a local folder and on S3 (moto on loopback, through s3fs), and
an S3 failure reads as one line that names the object."""

from __future__ import annotations

import errno
import multiprocessing
from pathlib import Path

import pytest

from cloob_core import storage


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    return f"s3://{request.getfixturevalue('s3_bucket')}/store"


def test_reads_listings_and_deletes_agree_on_both_stores(root):
    storage.write_bytes(storage.join(root, "a.json"), b'{"a": 1}')
    storage.write_bytes(storage.join(root, "b.tar"), b"tar")
    storage.write_bytes(storage.join(root, "sub", "c.tar"), b"nested")
    storage.write_bytes(storage.join(root, f"{storage.LEASE_PREFIX}.json"), b"{}")

    assert storage.read_json(storage.join(root, "a.json")) == {"a": 1}
    assert storage.list_names(root) == ["a.json", "b.tar"]  # files directly in it, leases never
    assert storage.list_names(root, ".tar") == ["b.tar"]
    assert storage.list_names(storage.join(root, "a.json")) == []  # a file is no folder: not itself listed
    assert storage.list_names(storage.join(root, "none")) == []
    entries = storage.tree_entries(root)
    assert [(path, size) for path, size, _ in entries] == [("a.json", 8), ("b.tar", 3), ("sub/c.tar", 6)]
    assert storage.file_version(storage.join(root, "sub", "c.tar")) == entries[2][1:]
    assert storage.file_version(storage.join(root, "sub")) is None  # a folder is not a file
    assert storage.file_version(storage.join(root, "none")) is None
    assert storage.tree_entries(storage.join(root, "none")) == []

    assert storage.exists(storage.join(root, "sub")) and storage.exists(storage.join(root, "b.tar"))
    assert not storage.exists(storage.join(root, "none"))
    storage.delete(storage.join(root, "b.tar"))
    storage.delete(storage.join(root, "b.tar"))  # a second delete is no error
    assert not storage.exists(storage.join(root, "b.tar"))
    with pytest.raises(FileNotFoundError, match=r"b\.tar does not exist"):
        storage.read_bytes(storage.join(root, "b.tar"))
    assert storage.read_json_or(storage.join(root, "b.tar"), "default") == "default"


def test_a_rewritten_file_gets_a_new_version(root):
    location = storage.join(root, "x.bin")
    storage.write_bytes(location, b"one")
    first = storage.file_version(location)
    storage.write_bytes(location, b"two")  # same size: only the version tells them apart
    assert storage.file_version(location)[0] == first[0] and storage.file_version(location)[1] != first[1]


def test_trees_go_up_and_come_back_whole(root, tmp_path):
    local = tmp_path / "model"
    (local / "checkpoints").mkdir(parents=True)
    (local / "checkpoints" / "step.pt").write_bytes(b"ckpt")
    (local / "weights").mkdir()
    (local / "weights" / "w.safetensors").write_bytes(b"w" * 1000)
    (local / "info.json").write_text("{}")

    assert storage.upload_tree(local, root, exclude=("checkpoints",)) == ["info.json", "weights/w.safetensors"]
    back = tmp_path / "back"
    assert storage.download_tree(root, back) == ["info.json", "weights/w.safetensors"]
    assert (back / "weights" / "w.safetensors").read_bytes() == b"w" * 1000
    assert sorted(p.name for p in back.rglob("*")) == ["info.json", "w.safetensors", "weights"]  # no temporaries
    with pytest.raises(FileNotFoundError, match="holds no files"):
        storage.download_tree(storage.join(root, "none"), tmp_path / "nothing")


def test_a_folder_of_symbolic_links_goes_up_with_their_targets(root, tmp_path):
    # DVC's cache type `symlink` checks a model folder out as links into its cache: the files are the targets
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "ab12").write_bytes(b"weights")
    local = tmp_path / "model"
    local.mkdir()
    (local / "open_clip_model.safetensors").symlink_to(cache / "ab12")
    (local / "model_info.json").write_text("{}")
    assert storage.upload_tree(local, root) == ["model_info.json", "open_clip_model.safetensors"]
    assert storage.read_bytes(storage.join(root, "open_clip_model.safetensors")) == b"weights"


def test_readers_stream_and_seek_on_both_stores(root):
    data = bytes(range(256)) * 40_000  # 10 MB: more than one of the seeking reader's ranges
    location = storage.join(root, "big.bin")
    storage.write_bytes(location, data)
    with storage.open_read(location) as handle:
        assert handle.read() == data
    with storage.open_seekable(location) as handle:
        handle.seek(len(data) - 10)
        assert handle.read() == data[-10:]
        handle.seek(5)
        assert handle.read(3) == data[5:8]


def _read_in_child(location: str, results) -> None:
    with storage.open_read(location) as handle:
        results.put(handle.read())


def test_a_forked_worker_reads_s3_after_its_parent_did(s3_bucket):
    """Data-loader workers are forked from a process that already talked to S3: each gets clients of its own."""
    location = f"s3://{s3_bucket}/shard.tar"
    storage.write_bytes(location, b"shard bytes")
    assert storage.read_bytes(location) == b"shard bytes"  # the parent's clients exist before the fork
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_read_in_child, args=(location, results))
    child.start()
    assert results.get(timeout=60) == b"shard bytes"
    child.join(timeout=60)
    assert child.exitcode == 0


def test_a_missing_bucket_is_named_not_taken_for_an_empty_folder(s3_server):
    missing = "s3://no-such-bucket-for-storage/folder"
    for read in (storage.read_bytes, storage.tree_entries, storage.list_names, storage.file_version, storage.exists):
        with pytest.raises(FileNotFoundError, match=r"s3://no-such-bucket-for-storage/folder: its bucket does "):
            read(missing)


def test_an_s3_failure_names_the_object_and_the_error_code(fault_proxy, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    storage._s3_for_process.cache_clear()
    fault_proxy.add("slowdown", method="PUT", key="/slow.json", times=None)
    location = f"s3://{s3_bucket}/slow.json"
    with pytest.raises(OSError, match=r"^s3://\S+/slow.json: .*\(SlowDown\)$") as raised:
        storage.write_bytes(location, b"{}")
    assert raised.value.errno == errno.EBUSY  # the kind s3fs gave it is kept
    # botocore's retries are the only ones: AWS_MAX_ATTEMPTS requests, not s3fs's five tries of them each
    assert [what for method, path, what in fault_proxy.log if path.endswith("/slow.json")] == ["slowdown"] * 2


def test_an_ordinary_file_error_stays_as_the_os_gave_it(tmp_path):
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError):
        storage.read_bytes(tmp_path / "folder")
    assert storage.list_names(Path(tmp_path, "folder")) == []
