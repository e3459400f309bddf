"""The order the test files run in (longest first, for the workers' sake), and the shared fixtures: a real
S3-compatible server (moto's server mode) on 127.0.0.1, started and stopped here, and the packaged data sets
as shards, built once per worker."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: the tests that run
def pytest_collection_modifyitems(config, items):
    """Longest first, for the workers' sake (scripts/test.sh runs whole files per worker, in this order, with
    xdist's own reordering off): files by their number of slow tests (minutes each), then by their number of
    tests (xdist's own order), most first. A long file dispatched last would run on alone while the other workers
    idle: CI runs the default and slow tests in one session."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ordered = sorted(files.values(), key=lambda tests: (-sum(bool(t.get_closest_marker("slow")) for t in tests),
                                                         -len(tests)))
    items[:] = [item for tests in ordered for item in tests]


@pytest.fixture(scope="session")
def airflow_venv():
    """Airflow's venv (.venv-airflow), which the Airflow tests (tests/test_airflow_*.py) run Airflow in."""
    from airflow_harness import VENV

    if not (VENV / "bin" / "airflow").exists():
        pytest.fail("Airflow's venv (.venv-airflow) is missing: run scripts/airflow.sh --setup")
    return VENV


@pytest.fixture(scope="session")
def s3_server():
    """Endpoint URL of a moto S3 server on loopback; boto3 (and our spawned workers) find it via the env."""
    from moto.server import ThreadedMotoServer

    from cloob_core import storage

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    storage._s3_for_process.cache_clear()
    try:
        yield endpoint
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        storage._s3_for_process.cache_clear()


@pytest.fixture
def s3_bucket(s3_server, request):
    import hashlib
    import re

    from cloob_core import storage

    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-")
    name = f"cloob-{slug}-{hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:8]}"  # parametrized: distinct
    storage.s3_client().create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def mnist_train_shards(tmp_path_factory):
    """The packaged MNIST training split as 16 shards of 250 pairs (28x28 digits, as `cloob data shards` writes them);
    read-only for the tests that train on it."""
    from cloob_core.config import load_config
    from cloob_core.data.local import build_shards

    out = tmp_path_factory.mktemp("train") / "shards"
    config = load_config(overrides=["preprocess.resize_mode=no", "preprocess.shard_size=250"])
    build_shards("mnist", str(out), config, split="train", progress=False)
    return out


@pytest.fixture(scope="session")
def captioned_train_shards(tmp_path_factory):
    """The packaged captioned set's training split as `cloob data shards --source captioned` writes it with the
    default configuration (the DVC pipeline's own training set; a clean checkout has no data/): read-only for the
    tests that train on it."""
    from cloob_core.config import load_config
    from cloob_core.data.local import build_shards

    out = tmp_path_factory.mktemp("captioned") / "shards"
    build_shards("captioned", str(out), load_config(), split="train", progress=False)
    return out


@pytest.fixture
def pushgateway():
    """A stand-in Pushgateway on 127.0.0.1: (address, list of (path, body) it received)."""
    import http.server
    import threading

    received: list[tuple[str, str]] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"])).decode()))
            self.send_response(200)
            self.end_headers()

        def do_DELETE(self):  # a group deleted: recorded with the body "DELETE"
            received.append((self.path, "DELETE"))
            self.send_response(202)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def read_shards():
    """Samples of a shards folder (local or s3://) as plain webdataset reads them, in shard order:
    ``(RGB image as a numpy array, caption, metadata dict)``."""
    import json

    import numpy as np
    import webdataset as wds

    from cloob_core.data.shard_files import register_s3, shard_list

    def read(location: str) -> list[tuple]:
        register_s3()
        urls, _ = shard_list(location)
        pipeline = wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(), wds.decode("pilrgb"),
                                    wds.to_tuple("jpg;png", "txt", "json"))
        return [(np.asarray(image), caption, json.loads(meta) if isinstance(meta, bytes) else meta)
                for image, caption, meta in pipeline]

    return read


@pytest.fixture(scope="session")
def weights(tmp_path_factory):
    """A state dict of the cloob-tiny architecture, as ``cloob eval --architecture cloob-tiny --weights`` reads."""
    import torch

    from cloob_core.config import ModelConfig
    from cloob_core.model.dual_encoder import build_model

    path = tmp_path_factory.mktemp("model") / "weights.pt"
    torch.save(build_model(ModelConfig()).encoder.state_dict(), path)
    return path


@pytest.fixture(scope="session")
def untrained_export(tmp_path_factory):
    """The default architecture's initial weights (seed 0) exported as `cloob train` exports a model: the untrained
    model that `cloob eval` tests read (read-only; a test that changes it takes a copy)."""
    import torch

    from cloob_core.config import load_config
    from cloob_core.model.dual_encoder import build_model
    from cloob_core.model.export import export_model

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("random") / "model"
    export_model(build_model(load_config().model), folder, {"objective": "none", "steps": 0})
    return folder


@pytest.fixture
def fault_proxy(s3_bucket, s3_server, monkeypatch):
    """The loopback S3 server behind a fault-injecting proxy (tests/s3_fault_proxy.py): boto3 in this process and
    in the processes the test starts talk to the proxy; the bucket ``s3_bucket`` exists."""
    from s3_fault_proxy import FaultProxy

    from cloob_core import storage

    proxy = FaultProxy(s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.start())
    storage._s3_for_process.cache_clear()
    try:
        yield proxy
    finally:
        proxy.stop()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
        storage._s3_for_process.cache_clear()


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(bytes)``: a folder on a tmpfs of that size, for writes that run out of space for real (a
    mount needs root, which this project's machines and CI have). Unmounted at the end."""
    import shutil
    import subprocess

    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.fail("a small disk needs root and mount(8) (CI and the developers' machines have both)")
    mounted = []

    def make(size: int):
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
        mounted.append(folder)
        return folder

    try:
        yield make
    finally:
        for folder in mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)
