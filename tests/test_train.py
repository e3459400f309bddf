"""`cloob train` on CPU: learning, exact resume after SIGKILL, DDP = single process, accumulation = full batch,
S3 checkpoints, live Prometheus metrics."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trained_weights import largest_difference

from cloob_core.cli import main
from cloob_core.config import ConfigError, load_config
from cloob_core.model.export import load_exported
from cloob_core.objectives.names import OBJECTIVE_NAMES, POLY_VIEW_OBJECTIVES
from cloob_core.training.env import detect
from cloob_core.training.loop import train


@pytest.fixture
def shards(mnist_train_shards):
    return mnist_train_shards


def cli(shards: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cloob_core.cli", "train", "--shards", str(shards), "--output", str(output),
            "--no-progress", "--no-tensorboard", *extra]


def exported_state(output: Path) -> dict[str, torch.Tensor]:
    return load_file(output / "model" / "open_clip_model.safetensors")


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def test_a_tiny_model_learns_and_exports_for_open_clip(shards, tmp_path):
    config = load_config(overrides=[f"train.shards={shards}", "train.epochs=2", "train.log_every=5",
                                    "train.tensorboard=false"])
    result = train(config, tmp_path / "run", progress=False)
    history = [line.split(",") for line in (tmp_path / "run" / "loss_history.csv").read_text().splitlines()[1:]]
    losses = [float(row[1]) for row in history]
    assert len(history) == 62 // 5 + 1 and losses[-1] < 0.85 * losses[0]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 62 and metrics["final_loss"] == losses[-1]
    assert (tmp_path / "run" / "training_curves.png").read_bytes().startswith(b"\x89PNG")
    # the export is plain open_clip: the same embeddings as the trained model
    exported = load_exported(tmp_path / "run" / "model")
    model, info = exported.model, exported.info
    assert info["architecture"] == "cloob-tiny" and info["inv_tau"] == pytest.approx(30.0)
    images = torch.randn(4, 3, 32, 32)
    trained = result.model.eval()
    with torch.no_grad():
        assert torch.allclose(model.eval().encode_image(images, normalize=True), trained.encode_image(images),
                              atol=1e-6)  # the trained model runs channels-last: conv rounding differs


@pytest.mark.slow  # ~45 s, in the slow phase for the default one's budget (docs/development.md)
def test_sigkill_mid_run_then_resume_is_bit_identical(shards, tmp_path):
    settings = ["--steps", "24", "--batch-size", "64", "--checkpoint-every", "4", "--log-every", "4",
                "--workers", "2"]
    reference = subprocess.run(cli(shards, tmp_path / "whole", *settings), capture_output=True, text=True)
    assert reference.returncode == 0, reference.stderr
    run = subprocess.Popen(cli(shards, tmp_path / "killed", *settings), start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "killed" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (checkpoints / "step-00000012.pt").exists():
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)  # mid-epoch (an epoch of 4000 pairs is 62 steps of 64)
    run.wait()
    assert not (tmp_path / "killed" / "model").exists()
    resumed = subprocess.run(cli(shards, tmp_path / "killed", *settings, "--resume", "latest"),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr
    assert_identical(exported_state(tmp_path / "killed"), exported_state(tmp_path / "whole"))
    whole_history = (tmp_path / "whole" / "loss_history.csv").read_text()
    assert (tmp_path / "killed" / "loss_history.csv").read_text() == whole_history


def test_two_rank_ddp_equals_one_process_with_the_same_global_batch(shards, tmp_path):
    settings = ["--steps", "6", "--batch-size", "32", "--data-streams", "4", "--workers", "1", "--log-every", "2",
                "--set", "model.architecture=cloob-tiny-vit"]  # LayerNorm only: no per-rank BatchNorm statistics
    single = subprocess.run(cli(shards, tmp_path / "one", *settings), capture_output=True, text=True)
    assert single.returncode == 0, single.stderr
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    ddp = subprocess.run([*launcher, *cli(shards, tmp_path / "two", *settings)[1:]], capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "(2 rank(s)" in ddp.stdout
    one, two = exported_state(tmp_path / "one"), exported_state(tmp_path / "two")
    # Same data, same global batch, same loss; only the float32 summation order differs (gather, all-reduce).
    worst = largest_difference(one, two)
    print(f"largest parameter difference after 6 steps: {worst:.2e}")
    assert worst < 1e-6, worst  # measured: 1.2e-7


def test_gradient_accumulation_equals_the_full_batch():
    from cloob_core.model.dual_encoder import build_model
    from cloob_core.objectives.registry import build_objective
    from cloob_core.training.optim import build_optimizer
    from cloob_core.training.step import StepParts, accumulate_gradients

    torch.manual_seed(0)
    config = load_config(overrides=["model.architecture=cloob-tiny-vit", "model.learn_inv_tau=true"])
    images, tokens = torch.randn(24, 3, 32, 32, dtype=torch.float64), torch.randint(1, 400, (24, 16))
    grads = {}
    for k in (1, 2, 4):
        torch.manual_seed(0)
        model = build_model(config.model).double()
        parts = StepParts(model=model, objective=build_objective("cloob", beta=8.0),
                          optimizer=build_optimizer(model, config.optim),
                          scaler=torch.amp.GradScaler("cpu", enabled=False), device_type="cpu", accum_freq=k)
        loss = accumulate_gradients(parts, images, tokens).loss
        grads[k] = (loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    full_loss, full = grads[1]
    assert "encoder.logit_scale" in full  # the learnable temperature gets its gradient once, not k times
    for k in (2, 4):
        loss, accumulated = grads[k]
        assert torch.allclose(loss, full_loss, rtol=0, atol=1e-12)
        for name, grad in full.items():
            assert torch.allclose(accumulated[name], grad, rtol=1e-9, atol=1e-12), name


def test_checkpoints_go_to_s3_and_resume_from_there(shards, tmp_path, s3_bucket):
    from cloob_core import storage

    for path in shards.iterdir():  # the shards on S3 too
        storage.write_bytes(f"s3://{s3_bucket}/shards/{path.name}", path.read_bytes())
    shards = f"s3://{s3_bucket}/shards"
    mirror = f"s3://{s3_bucket}/run-1/checkpoints"
    settings = ["--batch-size", "64", "--checkpoint-every", "3", "--keep-checkpoints", "2", "--log-every", "3",
                "--workers", "0", "--checkpoint-sync", mirror]
    assert main(["train", "--shards", str(shards), "--output", str(tmp_path / "a"), "--no-progress",
                 "--no-tensorboard", "--steps", "9", *settings]) == 0
    assert storage.list_names(mirror) == ["step-00000006.pt", "step-00000006.pt.sha256", "step-00000009.pt",
                                          "step-00000009.pt.sha256"]  # kept the last 2, with their checksums
    for path in (tmp_path / "a").iterdir():  # the pod's disk is gone
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    # From the mirror's step 6 alone, with the run's configuration from the checkpoint: steps 7 to 9 again.
    assert main(["train", "--output", str(tmp_path / "a"), "--no-progress", "--resume",
                 f"{mirror}/step-00000006.pt"]) == 0
    assert main(["train", "--shards", str(shards), "--output", str(tmp_path / "b"), "--no-progress",
                 "--no-tensorboard", "--steps", "9", *settings]) == 0
    assert_identical(exported_state(tmp_path / "a"), exported_state(tmp_path / "b"))


def test_a_resume_takes_the_runs_configuration_from_its_checkpoint_and_refuses_a_change(shards, tmp_path, capsys):
    base = ["train", "--shards", str(shards), "--output", str(tmp_path), "--no-progress", "--no-tensorboard",
            "--steps", "4", "--batch-size", "32", "--workers", "0", "--checkpoint-every", "2"]
    assert main(base) == 0
    (tmp_path / "checkpoints" / "step-00000004.pt").unlink()  # as if stopped after step 2
    capsys.readouterr()
    for change, named in ((["--set", "model.architecture=cloob-tiny-vit"], "model.architecture 'cloob-tiny-vit'"),
                          (["--steps", "8"], "train.steps 8"), (["--set", "optim.warmup_steps=7"],
                                                                 "optim.warmup_steps 7")):
        assert main(["train", "--output", str(tmp_path), "--resume", "latest", *change]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0] and "would change that run" in err[0], err
    # Keys of how it runs may change; no flag at all continues the run as it was configured.
    assert main(["train", "--output", str(tmp_path), "--resume", "latest", "--workers", "1", "--log-every", "1"]) == 0
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 4
    # Through the stage function, a configuration of another run is refused too.
    (tmp_path / "checkpoints" / "step-00000004.pt").unlink()
    with pytest.raises(ConfigError, match=r"is of another run: train\.batch_size: 32 in the checkpoint, 16 now"):
        train(load_config(overrides=[f"train.shards={shards}", "train.steps=4", "train.batch_size=16",
                                     "train.workers=0"]), tmp_path, resume="latest", progress=False)


def test_prometheus_metrics_rise_during_a_run(shards, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = subprocess.Popen(cli(shards, tmp_path, "--steps", "400", "--batch-size", "32", "--log-every", "2",
                               "--workers", "1", "--metrics-port", str(port)),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def scrape(after: float = 0.0) -> dict[str, float]:
            """The metrics once the step counter is past ``after`` (waiting for the event, bounded)."""
            deadline = time.monotonic() + 120
            while True:
                try:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                except OSError:
                    assert time.monotonic() < deadline and run.poll() is None
                    time.sleep(0.2)
                    continue
                values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("cloob_train_"))
                if float(values.get("cloob_train_steps_total", 0)) > after:
                    return {k: float(v) for k, v in values.items()}
                assert time.monotonic() < deadline and run.poll() is None, "no step within the bound"
                time.sleep(0.2)

        first = scrape()
        second = scrape(after=first["cloob_train_steps_total"])
    finally:
        run.terminate()
        run.wait(timeout=30)
    assert second["cloob_train_steps_total"] > first["cloob_train_steps_total"]
    assert second["cloob_train_samples_total"] == 32 * second["cloob_train_steps_total"]
    assert second["cloob_train_samples_per_second"] > 0 and 0 < second["cloob_train_loss"] < 10
    assert "cloob_train_data_errors_total" in second
    # the collapse detector's figures of the last window (the rank of 32 rows of 64 dimensions is at most 31)
    assert "cloob_train_collapse_margin" in second and second["cloob_train_collapsed"] == 0
    assert 1 <= second['cloob_train_effective_rank{tower="image"}'] <= 31
    assert -1 <= second['cloob_train_mean_cosine{tower="text"}'] <= 1


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, (0, 1, 0)),
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}, (3, 8, 1)),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0"}, (1, 2, 0)),  # PyTorchJob
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, (5, 8, 1)),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (0, 1, 0)),
    ],
)
def test_launchers_are_detected(environ, expected):
    env = detect(environ)
    assert (env.rank, env.world_size, env.local_rank) == expected


def test_bad_settings_fail_with_the_key_named(shards, tmp_path):
    with pytest.raises(ConfigError, match=r"must be a multiple of train\.data_streams"):
        train(load_config(overrides=[f"train.shards={shards}", "train.batch_size=36", "train.data_streams=8"]),
              tmp_path)
    with pytest.raises(ValueError, match="cannot feed 32 data streams"):
        train(load_config(overrides=[f"train.shards={shards}", "train.data_streams=32"]), tmp_path)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_cpu(shards, tmp_path, precision):
    config = load_config(overrides=[f"train.shards={shards}", "train.steps=3", "train.batch_size=32",
                                    f"train.precision={precision}", "train.workers=0", "train.tensorboard=false",
                                    "train.accum_freq=2", "train.grad_clip_norm=1.0"])
    result = train(config, tmp_path, progress=False)
    assert 0 < result.metrics["final_loss"] < 10


def test_train_from_a_params_file(shards, tmp_path, capsys):
    import yaml

    params = yaml.safe_load(Path("params.yaml").read_text())
    params["train"].update(shards=str(shards), steps=3, batch_size=32, workers=0, log_every=1)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    assert main(["train", "--params", str(tmp_path / "params.yaml"), "--output", str(tmp_path / "run"),
                 "--no-progress"]) == 0
    assert "objective cloob, 3 steps of 32 pairs (1 rank(s))" in capsys.readouterr().out
    assert len((tmp_path / "run" / "loss_history.csv").read_text().splitlines()) == 4
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_metrics_are_pushed_to_a_pushgateway(shards, tmp_path, pushgateway):
    address, received = pushgateway
    config = load_config(overrides=[f"train.shards={shards}", "train.steps=4", "train.batch_size=32",
                                    "train.workers=0", "train.tensorboard=false", "train.checkpoint_every=2",
                                    f"train.pushgateway={address}", "train.metrics_linger_s=0"])
    train(config, tmp_path, progress=False)
    assert len(received) == 3  # two checkpoints and the end
    path, body = received[-1]
    assert "cloob_train_steps_total 4.0" in body and "cloob_train_failed 0.0" in body
    # grouped by run and rank: concurrent runs keep their own series on the gateway
    assert re.fullmatch(r"/metrics/job/cloob-train/rank/0/run/[A-Za-z0-9_.-]+-[0-9a-f]{8}", path), path
    other = load_config(overrides=[f"train.shards={shards}", "train.steps=2", "train.batch_size=32",
                                   "train.workers=0", "train.tensorboard=false", f"train.pushgateway={address}",
                                   "train.metrics_linger_s=0"])
    train(other, tmp_path / "second", progress=False)
    assert received[-1][0] != path


def test_a_diverging_run_records_its_loss_and_divergence_before_it_ends(shards, tmp_path, pushgateway):
    """The alerts on a NaN loss and on divergence read what the run pushed: before TrainingDiverged ends the
    process, the loss gauge and cloob_train_diverged are set and pushed."""
    from cloob_core.training.loop import TrainingDiverged

    address, received = pushgateway
    config = load_config(overrides=[f"train.shards={shards}", "train.steps=12", "train.batch_size=32",
                                    "train.workers=0", "train.tensorboard=false", "train.checkpoint_every=2",
                                    "train.log_every=1", "optim.lr=1e8", "optim.warmup_steps=0",
                                    f"train.pushgateway={address}"])
    with pytest.raises(TrainingDiverged):
        train(config, tmp_path, progress=False)
    bodies = [body for _, body in received]
    assert any("cloob_train_diverged 1.0" in body for body in bodies)
    last = bodies[-1]
    assert "cloob_train_diverged 1.0" in last
    loss = re.search(r"^cloob_train_loss (\S+)$", last, re.M).group(1)
    assert loss in ("NaN", "+Inf", "-Inf"), loss
    # the run ended by a failure of its own: its group stays, marked, so the stalled and checkpoint alerts leave it
    # (before, both fired until someone deleted the group); a run that reached its end is never marked
    assert "cloob_train_failed 1.0" in last and all("cloob_train_failed 1.0" not in body for body in bodies[:-1])


def test_a_restricted_negative_run_resumes_exactly_with_its_schedule_and_queue(shards, tmp_path):
    """cloob_ring with an annealed band and a queue: stopping at a checkpoint and resuming gives the same
    model as running through, so the band's step and the queue's contents travel in the checkpoint."""
    settings = ["--batch-size", "32", "--checkpoint-every", "3", "--log-every", "3", "--workers", "1",
                "--set", "train.objective=cloob_ring", "--set", "objective.p_out=0.3", "--set", "objective.p_in=0.05",
                "--set", "objective.anneal_steps=4", "--set", "objective.queue_size=64"]
    whole = subprocess.run(cli(shards, tmp_path / "whole", "--steps", "6", *settings), capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-3000:]
    halfway = tmp_path / "whole" / "checkpoints" / "step-00000003.pt"
    state = torch.load(halfway, weights_only=True)
    assert state["objective"]["step"] == 3 and state["objective"]["queue"]["image"].shape[0] == 64
    second = subprocess.run([sys.executable, "-m", "cloob_core.cli", "train", "--output", str(tmp_path / "parts"),
                             "--resume", str(halfway)], capture_output=True, text=True)  # its configuration
    assert second.returncode == 0, second.stderr[-3000:]
    assert_identical(exported_state(tmp_path / "parts"), exported_state(tmp_path / "whole"))


def test_a_poly_view_run_draws_image_and_text_views(shards, tmp_path, capsys):
    from kept_ring import KeptRing

    from cloob_core.data.shard_files import shard_list
    from cloob_core.training.images import TrainImages
    from cloob_core.training.streams import (
        StreamChunks,
        StreamSettings,
        StreamStart,
        draw_captions,
        sample_captions,
        stream_shards,
    )

    urls, _ = shard_list(str(shards))
    settings = StreamSettings(streams=4, chunk_size=4, seed=0, shuffle_buffer=10, image_views=3, text_views=2)
    ring = KeptRing([0], settings)
    chunks = StreamChunks(stream_shards(urls, 4), settings, StreamStart([0]), TrainImages(8),
                          lambda texts: torch.tensor([[sum(t.encode()), len(t)] for t in texts]), ring)
    [chunk] = next(iter(chunks))  # one item per step: the chunks of the worker's streams
    images, tokens = ring.of(chunk)
    assert images.shape == (12, 3, 8, 8) and len(tokens) == 8  # sample-major: 4 samples x views
    for i in range(4):  # a sample's two text views are two phrasings of its digit
        first, second = tokens[2 * i : 2 * i + 2]
        assert not torch.equal(first, second)
    sample = {"txt": b"a handwritten three.", "json": b'{"captions": ["a handwritten three.", "3", "three"]}'}
    assert sample_captions(sample) == ["a handwritten three.", "3", "three"]
    assert sorted(draw_captions(["a", "b"], 5)) == ["a", "a", "a", "b", "b"]
    assert sample_captions({"txt": "only one"}) == ["only one"]

    assert main(["train", "--shards", str(shards), "--output", str(tmp_path / "run"), "--no-progress",
                 "--no-tensorboard", "--steps", "3", "--batch-size", "16", "--workers", "0", "--set",
                 "train.objective=pvc_geometric", "--set", "train.image_views=2", "--set", "train.text_views=2"]) == 0
    assert "objective pvc_geometric, 3 steps of 16 pairs" in capsys.readouterr().out


@pytest.mark.parametrize("objective", sorted(OBJECTIVE_NAMES))
def test_every_objective_trains_from_the_cli(objective, shards, tmp_path):
    views = ["--set", "train.image_views=2", "--set", "train.text_views=2"] if objective in POLY_VIEW_OBJECTIVES else []
    assert main(["train", "--shards", str(shards), "--output", str(tmp_path / "run"), "--no-progress",
                 "--no-tensorboard", "--steps", "2", "--batch-size", "16", "--workers", "0", "--log-every", "1",
                 "--objective", objective, "--set", "objective.queue_size=32", *views]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["objective"] == objective and math.isfinite(metrics["final_loss"])


@pytest.mark.slow  # ~50 s, in the slow phase for the default one's budget (docs/development.md)
def test_a_checkpoint_of_two_ranks_resumes_on_one_and_on_four(shards, tmp_path):
    """With the checkpoint's data_streams (4) the global batch is the same on any number of ranks that divides
    it, so resuming on 1 or 4 ranks continues the data exactly: the result is the uninterrupted run's but for
    float32 summation order (the gather and all-reduce)."""
    settings = ["--steps", "6", "--batch-size", "32", "--data-streams", "4", "--workers", "0", "--log-every", "3",
                "--checkpoint-every", "3", "--set", "model.architecture=cloob-tiny-vit"]
    environ = {**os.environ, "OMP_NUM_THREADS": "1"}

    def ranks(n: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]

    whole = subprocess.run(cli(shards, tmp_path / "whole", *settings), capture_output=True, text=True, env=environ)
    assert whole.returncode == 0, whole.stderr
    two = subprocess.run([*ranks(2), *cli(shards, tmp_path / "two", *settings)[1:]], capture_output=True, text=True,
                         env=environ)
    assert two.returncode == 0, two.stderr
    halfway = tmp_path / "two" / "checkpoints" / "step-00000003.pt"
    assert torch.load(halfway, weights_only=True)["world_size"] == 2
    for n in (1, 4):
        resumed = subprocess.run([*ranks(n), *cli(shards, tmp_path / f"on{n}", *settings)[1:], "--resume",
                                  str(halfway)], capture_output=True, text=True, env=environ)
        assert resumed.returncode == 0, resumed.stderr
        assert f"({n} rank(s)" in resumed.stdout and "resuming from" in resumed.stderr
        state = exported_state(tmp_path / f"on{n}")
        reference = exported_state(tmp_path / "whole")
        worst = max((state[k] - reference[k]).abs().max().item() for k in state)
        assert worst < 1e-5, (n, worst)
        saved = torch.load(tmp_path / f"on{n}" / "checkpoints" / "step-00000006.pt", weights_only=True)
        assert saved["positions"] == torch.load(tmp_path / "whole" / "checkpoints" / "step-00000006.pt",
                                                weights_only=True)["positions"]


def test_resuming_on_another_number_of_streams_starts_each_stream_on_a_new_pass(shards, tmp_path, caplog):
    """data_streams 2 cannot split over 4 ranks: the run continues on 4 streams, whose positions cannot carry over
    (they read other shards). Every stream starts the pass after the furthest one reached; model, optimiser and
    schedule continue at the step."""
    import logging

    base = [f"train.shards={shards}", "train.batch_size=16", "train.workers=0", "train.tensorboard=false",
            "train.checkpoint_every=3", "train.steps=6", "model.architecture=cloob-tiny-vit"]
    first = load_config(overrides=[*base, "train.data_streams=2"])  # its checkpoint of step 3 is the one resumed
    train(first, tmp_path / "two", progress=False)
    saved = torch.load(tmp_path / "two" / "checkpoints" / "step-00000003.pt", weights_only=True)
    assert saved["positions"] == {"0": [0, 24], "1": [0, 24]}  # 3 steps of 8 samples a stream, in pass 0
    with caplog.at_level(logging.WARNING):
        result = train(load_config(overrides=[*base, "train.data_streams=4"]), tmp_path / "four", progress=False,
                       resume=str(tmp_path / "two" / "checkpoints" / "step-00000003.pt"))
    assert result.metrics["resumed_from_step"] == 3
    assert any("written with 2 data streams, this run has 4: each stream starts pass 1" in r.getMessage()
               for r in caplog.records)
    final = torch.load(tmp_path / "four" / "checkpoints" / "step-00000006.pt", weights_only=True)
    assert final["positions"] == {str(v): [1, 12] for v in range(4)}  # 3 steps of 4 samples, in pass 1


def test_the_final_metrics_stay_up_for_a_scrape_then_a_finished_runs_group_goes(pushgateway):
    """Before, /metrics stopped right after the loop, so a 30 s scrape rarely saw progress 1 and CloobTrainingGone
    fired on runs that succeeded; and a run's Pushgateway group stayed for ever. Now both stay up for
    train.metrics_linger_s (the process's exit waits), then the server stops and a finished run's group is
    deleted; a failed run's group stays for the alerts."""
    import socket
    import urllib.request

    from cloob_core.training.monitor import Monitor

    address, received = pushgateway
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monitor = Monitor(enabled=True, total_steps=4, start_step=0, output=Path("."), progress=False, tensorboard=False,
                      metrics_port=port, pushgateway=address, run="r1", linger_s=30.0).start()
    monitor._metrics["progress"].set(1.0)
    monitor.close(ended=True)
    served = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "cloob_train_progress_ratio 1.0" in served  # still there after the loop
    assert received[-1][1] != "DELETE"
    monitor._linger_until = 0.0  # as if linger_s had passed
    monitor.stop()  # what the exit does then
    assert received[-1] == ("/metrics/job/cloob-train/rank/0/run/r1", "DELETE")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    failed = Monitor(enabled=True, total_steps=4, start_step=0, output=Path("."), progress=False, tensorboard=False,
                     pushgateway=address, run="r2", linger_s=30.0).start()
    failed.close(ended=False)  # no server to keep, and a failed run's group stays
    assert received[-1][1] != "DELETE" and "/run/r2" in received[-1][0]
