"""`cloob eval` end to end: a trained tiny model, a random one, the packaged MNIST split and a user ImageFolder."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest
from image_server import photo_bytes

from cloob_core.cli import main
from cloob_core.config import load_config
from cloob_core.evaluation.clip_benchmark_loader import load_cloob
from cloob_core.training.loop import train


@pytest.fixture(scope="module")
def trained(mnist_train_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    config = load_config(overrides=[f"train.shards={mnist_train_shards}", "train.epochs=3", "train.tensorboard=false"])
    train(config, root / "run", progress=False)
    return root / "run" / "model"


def run(task: str, *args: str) -> int:
    """`cloob eval TASK`, on the packaged MNIST split unless the arguments name other data."""
    flag = "--train-data" if task == "linear-probe" else "--data"
    return main(["eval", task, *args, *([] if flag in args else [flag, "mnist"]), "--no-progress"])


def test_zero_shot_trained_beats_chance_random_does_not(trained, untrained_export, tmp_path, capsys):
    assert run("zeroshot", "--model", str(trained), "--output", str(tmp_path / "t")) == 0
    trained_top1 = json.loads((tmp_path / "t" / "mnist-test_zeroshot_classification.json").read_text())
    assert trained_top1["metrics"]["acc1"] > 0.3  # chance is 0.1; 3 epochs reach about 0.49
    assert run("zeroshot", "--model", str(untrained_export), "--output", str(tmp_path / "r")) == 0
    random_top1 = json.loads((tmp_path / "r" / "mnist-test_zeroshot_classification.json").read_text())
    assert abs(random_top1["metrics"]["acc1"] - 0.1) < 0.08
    record = trained_top1
    assert {"dataset", "model", "pretrained", "task", "metrics"} <= set(record)  # CLIP_benchmark's layout
    assert record["task"] == "zeroshot_classification" and record["model"] == "cloob-tiny"
    metrics = record["metrics"]
    assert len(metrics["confusion_matrix"]) == 10 and sum(map(sum, metrics["confusion_matrix"])) == 1000
    assert metrics["mean_per_class_recall"] == pytest.approx(sum(metrics["per_class_accuracy"]) / 10)
    for plot in ("per_class", "confusion"):
        png = tmp_path / "t" / f"mnist-test_zeroshot_classification_{plot}.png"
        assert png.read_bytes().startswith(b"\x89PNG")
    assert "mnist-test_zeroshot_classification_confusion.png" in (tmp_path / "t" / "report.md").read_text()
    assert run("zeroshot", "--model", str(trained), "--output", str(tmp_path / "h"), "--hopfield-beta", "8") == 0
    hopfield = json.loads((tmp_path / "h" / "mnist-test_zeroshot_classification.json").read_text())
    assert hopfield["metrics"]["embeddings"] == "hopfield" and hopfield["metrics"]["acc1"] > 0.3


def test_all_four_tasks_on_the_mnist_split_write_one_report(trained, tmp_path, caplog):
    out = tmp_path / "all"
    for task in ("zeroshot", "linear-probe", "retrieval", "diagnostics"):
        assert run(task, "--model", str(trained), "--output", str(out)) == 0
    combined = json.loads((out / "metrics.json").read_text())
    assert set(combined) == {f"mnist-test_{t}" for t in ("zeroshot_classification", "linear_probe",
                                                                    "zeroshot_retrieval", "diagnostics")}
    assert combined["mnist-test_linear_probe"]["lp_acc1"] > 0.8
    diagnostics = json.loads((out / "mnist-test_diagnostics.json").read_text())["metrics"]
    assert 1 <= diagnostics["effective_eigenvalues_image"] <= 64 and len(diagnostics["spectrum_image"]) == 64
    assert 0 < diagnostics["positive_probability_p1"] < 1
    retrieval = combined["mnist-test_zeroshot_retrieval"]
    assert 0 <= retrieval["image_retrieval_recall@1"] <= retrieval["image_retrieval_recall@10"] <= 1
    # features are cached: a second run reads them back and gives the same numbers
    with caplog.at_level(logging.DEBUG, logger="cloob_core.evaluation.features"):
        assert run("linear-probe", "--model", str(trained), "--output", str(out)) == 0
    assert "features from cache" in caplog.text
    again = json.loads((out / "metrics.json").read_text())["mnist-test_linear_probe"]
    assert again == combined["mnist-test_linear_probe"]


def test_a_user_image_folder_with_a_class_name_file(trained, tmp_path, capsys):
    root = tmp_path / "photos"
    for split, count in (("train", 12), ("test", 6)):
        for label, folder in enumerate(("c0", "c1", "c2")):
            (root / split / folder).mkdir(parents=True)
            for i in range(count):
                (root / split / folder / f"{i}.jpg").write_bytes(photo_bytes(100 * label + i + (50 if split == "test"
                                                                                                 else 0)))
    names = tmp_path / "classes.json"
    names.write_text(json.dumps({"classnames": ["china", "flower", "mixed"], "templates": ["a photo of {c}."]}))
    out = tmp_path / "out"
    common = ["--model", str(trained), "--output", str(out), "--classnames", str(names)]
    assert run("zeroshot", "--data", str(root), *common) == 0
    assert run("linear-probe", "--train-data", str(root), "--test-data", str(root), *common) == 0
    assert run("retrieval", "--data", str(root), *common) == 0
    assert run("diagnostics", "--data", str(root), *common) == 0
    text = capsys.readouterr().out
    assert "test zero-shot" in text and "test linear probe" in text
    zero_shot = json.loads((out / "photos-test_zeroshot_classification.json").read_text())["metrics"]
    assert len(zero_shot["per_class_accuracy"]) == 3 and zero_shot["chance"] == pytest.approx(1 / 3)
    probe = json.loads((out / "photos-test_linear_probe.json").read_text())["metrics"]
    assert probe["train_size"] == 36 and 0 <= probe["lp_acc1"] <= 1


def test_several_captions_per_image_from_a_csv(trained, tmp_path):
    images = tmp_path / "img"
    images.mkdir()
    rows = []
    for i in range(8):
        (images / f"{i}.jpg").write_bytes(photo_bytes(i))
        rows += [(f"img/{i}.jpg", f"photo {i}"), (f"img/{i}.jpg", f"another caption of photo {i}")]
    with open(tmp_path / "captions.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["image", "caption"])
        writer.writerows(rows)
    assert run("retrieval", "--model", str(trained), "--data", str(tmp_path / "captions.csv"), "--output",
               str(tmp_path / "out")) == 0
    metrics = json.loads((tmp_path / "out" / "captions_zeroshot_retrieval.json").read_text())["metrics"]
    assert metrics["images"] == 8 and metrics["captions"] == 16
    assert metrics["image_retrieval_recall@10"] == 1.0  # only 8 images: every correct image is within the top 10
    # 16 captions, two of them correct: the better one can be beaten by at most the other 14
    assert 1 <= metrics["text_retrieval_mean_rank"] <= 15
    # the same table with its own column names, read with the flags every command that reads a table takes
    (tmp_path / "own.csv").write_text((tmp_path / "captions.csv").read_text().replace("image,caption", "file,text", 1))
    assert run("retrieval", "--model", str(trained), "--data", str(tmp_path / "own.csv"), "--output",
               str(tmp_path / "own"), "--url-col", "file", "--caption-col", "text") == 0
    own = json.loads((tmp_path / "own" / "own_zeroshot_retrieval.json").read_text())["metrics"]
    assert own["images"] == 8 and own["captions"] == 16


def test_open_clip_weights_and_the_clip_benchmark_loader(trained, tmp_path, capsys):
    weights = trained / "open_clip_model.safetensors"
    assert run("zeroshot", "--architecture", "cloob-tiny", "--weights", str(weights), "--output",
               str(tmp_path / "a")) == 0
    assert run("zeroshot", "--model", str(trained), "--output", str(tmp_path / "b")) == 0
    a = json.loads((tmp_path / "a" / "mnist-test_zeroshot_classification.json").read_text())["metrics"]
    b = json.loads((tmp_path / "b" / "mnist-test_zeroshot_classification.json").read_text())["metrics"]
    assert a["acc1"] == b["acc1"]
    _model, transform, tokenizer = load_cloob("cloob-tiny", str(trained))
    assert tokenizer(["a digit"]).shape == (1, 16) and transform.__class__.__name__ == "Compose"
    with pytest.raises(ValueError, match="not RN50"):
        load_cloob("RN50", str(trained))


def test_tasks_say_what_the_data_lacks(trained, tmp_path, capsys):
    root = tmp_path / "plain"
    (root / "a").mkdir(parents=True)
    (root / "a" / "0.jpg").write_bytes(photo_bytes(0))
    assert run("zeroshot", "--model", str(trained), "--data", str(root), "--output", str(tmp_path / "o")) == 2
    assert "has 1 class name(s): zero-shot classification ranks at least two" in capsys.readouterr().err
    assert run("zeroshot", "--data", str(root), "--output", str(tmp_path / "o")) == 2
    assert "give --model" in capsys.readouterr().err


def test_exported_model_folder_must_be_ours(tmp_path, capsys):
    Path(tmp_path / "nothing").mkdir()
    assert run("zeroshot", "--model", str(tmp_path / "nothing"), "--output", str(tmp_path / "o")) == 2
    assert "not a `cloob train` model folder" in capsys.readouterr().err


def test_packaged_class_names_and_templates():
    from cloob_core.evaluation.class_sets import packaged_class_sets
    from cloob_core.evaluation.inputs import read_class_file

    sets = packaged_class_sets()
    assert {"imagenet", "imagenet_v2", "cifar10", "pets", "flowers102", "caltech101", "eurosat"} <= set(sets)
    names, templates = read_class_file("imagenet")
    assert len(names) == 1000 and len(templates) == 80 and all("{}" in t for t in templates)
    names, templates = read_class_file("pets")
    assert len(names) == 37 and names[0] == "Abyssinian"
    # the paper's 20 zero-shot sets, each with its published number of classes and at least one template
    expected = {"birdsnap": 500, "country211": 211, "flowers102": 102, "gtsrb": 43, "ucf101": 101,
                "stanford_cars": 196, "imagenet": 1000, "imagenet_v2": 1000, "caltech101": 102, "cifar10": 10,
                "cifar100": 100, "dtd": 47, "eurosat": 10, "fer2013": 7, "fgvc_aircraft": 100, "food101": 101,
                "pets": 37, "resisc45": 45, "stl10": 10, "sun397": 397}
    for name, count in expected.items():
        names, templates = read_class_file(name)
        assert len(names) == count, name
        if not name.startswith("imagenet"):  # CLIP's ImageNet list names two pairs of classes alike (crane, maillot)
            assert len(set(names)) == count, name
        assert templates and all(t.count("{}") == 1 for t in templates), name


def test_several_test_sets_and_their_mean(trained, tmp_path, capsys):
    root = tmp_path / "sets"
    for variant in ("matched", "threshold"):
        for label, folder in enumerate(("c0", "c1")):
            (root / variant / folder).mkdir(parents=True)
            for i in range(4):
                (root / variant / folder / f"{i}.jpg").write_bytes(photo_bytes(10 * label + i + len(variant)))
    names = tmp_path / "classes.json"
    names.write_text(json.dumps({"classnames": ["china", "flower"], "templates": ["a photo of {c}."]}))
    assert run("zeroshot", "--model", str(trained), "--data", str(root / "matched"), str(root / "threshold"),
               "--classnames", str(names), "--name", "two-sets", "--output", str(tmp_path / "out")) == 0
    combined = json.loads((tmp_path / "out" / "two-sets_zeroshot_classification.json").read_text())["metrics"]
    per_set = [json.loads((tmp_path / "out" / f"{v}_zeroshot_classification.json").read_text())["metrics"]["acc1"]
               for v in ("matched", "threshold")]
    assert combined["acc1"] == pytest.approx(sum(per_set) / 2)
    assert set(combined["test_sets"]) == {"matched", "threshold"}
    assert "two-sets over 2 test sets" in capsys.readouterr().out
