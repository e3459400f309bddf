from pathlib import Path

import pytest
import yaml

from cloob_core.config import CloobConfig, ConfigError, dump_defaults, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_params_yaml_is_the_defaults():
    """params.yaml is the DVC view of the typed config: the same values, documented once in cloob_core/config."""
    assert yaml.safe_load((ROOT / "params.yaml").read_text()) == CloobConfig().model_dump()
    assert yaml.safe_load(dump_defaults()) == CloobConfig().model_dump()


def test_paper_defaults():
    config = CloobConfig()
    assert config.model.inv_tau == 30.0 and not config.model.learn_inv_tau
    assert config.train.objective == "cloob" and config.objective.beta == 8.0
    assert config.optim.weight_decay == 0.1


def test_file_then_overrides(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("train:\n  objective: clip\n  epochs: 3\n")
    config = load_config(path, ["train.epochs=5", "model.learn_inv_tau=true"])
    assert config.train.objective == "clip"
    assert config.train.epochs == 5
    assert config.model.learn_inv_tau is True
    assert config.train.batch_size == CloobConfig().train.batch_size


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.objective=simclr"], "train.objective"),
        (["objective.beta=-1"], "objective.beta"),
        (["model.inv_tau=500"], "model.inv_tau"),
        (["train.epochs=many"], "train.epochs"),
        (["train.epochz=3"], "train.epochz: unknown key"),
        (["nosuchsection.x=1"], "nosuchsection: unknown key"),
        (["train.epochs"], "section.key=value"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)


def test_the_paper_presets_apply_over_the_params_file_and_under_overrides():
    cc3m = load_config(preset="cc3m")  # §5.1, App. A.2.2: RN50, batch 512, lr 1e-3, 20k warm-up, beta 8, 31 epochs
    assert (cc3m.model.architecture, cc3m.train.batch_size, cc3m.optim.lr, cc3m.optim.warmup_steps,
            cc3m.objective.beta, cc3m.train.epochs, cc3m.model.inv_tau) == ("RN50", 512, 1e-3, 20_000, 8.0, 31, 30.0)
    yfcc = load_config(preset="yfcc", overrides=["train.epochs=2"])
    assert (yfcc.train.batch_size, yfcc.optim.lr, yfcc.objective.beta, yfcc.train.epochs) == (1024, 5e-4, 14.3, 2)
    with pytest.raises(ConfigError, match="unknown preset 'cc12m'"):
        load_config(preset="cc12m")
    # the ViT-B family: open_clip's ViT-B-32 optimiser recipe (one cosine, no restarts) with the default start
    # without Hopfield retrieval
    vit = load_config(preset="vit-b", overrides=["model.architecture=ViT-B-16"])
    assert (vit.model.architecture, vit.optim.lr, vit.optim.warmup_steps, vit.optim.weight_decay, vit.optim.beta2,
            vit.optim.eps, vit.optim.lr_cycles, vit.objective.start_without_hopfield) == (
        "ViT-B-16", 5e-4, 2_000, 0.2, 0.98, 1e-6, 1, "warmup")
    # ViT-B-32 from scratch on a CPU: the configuration in which CLIP and CLOOB both learn on it here
    cpu = load_config(preset="vit-b-cpu")
    assert (cpu.model.architecture, cpu.train.batch_size, cpu.optim.lr, cpu.optim.warmup_steps, cpu.optim.lr_cycles,
            cpu.train.steps, cpu.objective.start_without_hopfield) == ("ViT-B-32", 32, 1e-4, 10, 1, 120, "warmup")


@pytest.mark.parametrize(("train", "message"), [
    ({"batch_size": 100, "data_streams": 8}, "train.batch_size (100) must be a multiple of train.data_streams (8)"),
    ({"batch_size": 64, "data_streams": 8, "accum_freq": 3},
     "train.batch_size 64 must split into 1 rank(s) x train.accum_freq 3 equal micro-batches"),
])
def test_a_batch_that_does_not_split_is_refused_when_the_config_is_read(train, message):
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=[f"train.{key}={value}" for key, value in train.items()])
    assert str(refused.value) == f"invalid configuration: {message}"


def test_the_run_shape_is_checked_for_the_ranks_of_a_launch():
    train = load_config(overrides=["train.data_streams=8"]).train  # batch 128 in 8 streams
    train.check_shape(8)
    CloobConfig().train.check_shape(16)  # auto streams: chosen to fit the ranks (tests/test_run_shape.py)
    for ranks, message in ((3, r"data_streams \(8\) must be a multiple of the number of ranks \(3\)"),
                           (16, r"data_streams \(8\) must be a multiple of the number of ranks \(16\)")):
        with pytest.raises(ConfigError, match=message):
            train.check_shape(ranks)
    accumulating = load_config(overrides=["train.batch_size=12", "train.data_streams=2", "train.accum_freq=4"]).train
    accumulating.check_shape(1)  # 12 in 4 micro-batches of 3
    with pytest.raises(ConfigError, match=r"12 must split into 2 rank\(s\) x train.accum_freq 4"):
        accumulating.check_shape(2)  # 6 per rank: not 4 equal micro-batches


def test_a_rank_of_a_run_that_cannot_split_stops_before_the_process_group_waits(tmp_path, monkeypatch):
    """Under a launcher of 3 ranks a batch in 8 streams cannot split: the rank says so at once. Were the check
    after the process group started, this rank would wait for two others that never come."""
    from cloob_core.training.loop import train

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"data_streams \(8\) must be a multiple of the number of ranks \(3\)"):
        train(load_config(overrides=[f"train.shards={tmp_path / 'none'}", "train.data_streams=8"]), tmp_path / "run")
