"""`cloob data eval-set`: ImageFolder trees and labelled manifests to CLIP_benchmark's wds layout, read back by
`cloob eval` (local and S3) and by webdataset the way CLIP_benchmark's builder reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from image_server import image_folder, photo_bytes
from PIL import Image

from cloob_core.cli import main
from cloob_core.data.eval_set import build_eval_set
from cloob_core.data.manifest import ManifestError

CLASSES = ("cat", "dog", "sea_lion")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """train/ and test/ ImageFolder trees of real photos, one of them a PNG and one a BMP."""
    root = tmp_path_factory.mktemp("photos") / "pets"
    image_folder(root, CLASSES, {"train": 4, "test": 3})
    Image.open(root / "test" / "cat" / "0.jpg").save(root / "test" / "cat" / "9.png")
    Image.open(root / "test" / "dog" / "0.jpg").save(root / "test" / "dog" / "9.bmp")
    return root


def read_like_clip_benchmark(output: Path, split: str) -> list[tuple[Image.Image, int]]:
    """CLIP_benchmark's build_wds_dataset, as its builder reads a classification set."""
    import webdataset as wds

    count = int((output / split / "nshards.txt").read_text())
    pattern = str(output / split / f"{{0..{count - 1}}}.tar")
    dataset = (wds.WebDataset(pattern, nodesplitter=lambda src: src, shardshuffle=False)
               .decode(wds.autodecode.ImageHandler("pil", extensions=["webp", "png", "jpg", "jpeg"]))
               .to_tuple(["webp", "png", "jpg", "jpeg"], "cls"))
    return list(dataset)


def test_an_image_folder_becomes_the_wds_layout_in_image_folder_order(folder, tmp_path):
    from torchvision.datasets import ImageFolder

    out = tmp_path / "wds"
    result = build_eval_set(str(folder), str(out), shard_size=4)
    assert result.samples == {"test": 11, "train": 12} and result.classnames == ["cat", "dog", "sea lion"]
    assert (out / "classnames.txt").read_text() == "cat\ndog\nsea lion\n"
    assert (out / "zeroshot_classification_templates.txt").read_text() == "a photo of a {c}.\n"
    assert (out / "test" / "nshards.txt").read_text() == "3\n"
    samples = read_like_clip_benchmark(out, "test")
    reference = ImageFolder(str(folder / "test"))
    assert [label for _, label in samples] == [label for _, label in reference.samples]
    for (image, _), (path, _) in zip(samples, reference.samples, strict=True):
        assert image.convert("RGB").tobytes() == Image.open(path).convert("RGB").tobytes()


def test_cloob_eval_scores_the_wds_copy_exactly_as_the_folder(capsys, folder, tmp_path, weights):
    out = tmp_path / "wds"
    assert main(["data", "eval-set", "--source", str(folder), "--output", str(out), "--shard-size", "5"]) == 0
    templates = tmp_path / "templates.json"
    templates.write_text(json.dumps({"classnames": ["cat", "dog", "sea lion"], "templates": ["a photo of a {c}."]}))
    common = ["--architecture", "cloob-tiny", "--weights", str(weights), "--no-cache", "--no-progress"]
    assert main(["eval", "zeroshot", "--data", str(out), "--output", str(tmp_path / "a"), *common]) == 0
    assert main(["eval", "zeroshot", "--data", str(folder), "--classnames", str(templates), "--output",
                 str(tmp_path / "b"), *common]) == 0
    wds_result = json.loads((tmp_path / "a" / "wds-test_zeroshot_classification.json").read_text())["metrics"]
    folder_result = json.loads((tmp_path / "b" / "pets-test_zeroshot_classification.json").read_text())["metrics"]
    assert wds_result["confusion_matrix"] == folder_result["confusion_matrix"]
    assert wds_result["acc1"] == folder_result["acc1"]


def test_the_layout_on_s3_is_read_by_cloob_eval(capsys, folder, tmp_path, weights, s3_bucket):
    target = f"s3://{s3_bucket}/benchmarks/pets"
    assert main(["data", "eval-set", "--source", str(folder), "--output", target]) == 0
    assert main(["eval", "retrieval", "--data", target, "--split", "train", "--architecture", "cloob-tiny",
                 "--weights", str(weights), "--output", str(tmp_path / "r"), "--no-cache", "--no-progress"]) == 0
    record = json.loads((tmp_path / "r" / "pets-train_zeroshot_retrieval.json").read_text())
    assert record["metrics"]["images"] == 12


def test_a_labelled_manifest_with_splits(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    rows = ["image,label,split"]
    for i in range(6):
        (images / f"{i}.jpg").write_bytes(photo_bytes(i))
        rows.append(f"images/{i}.jpg,{CLASSES[i % 2]},{'train' if i < 4 else 'test'}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    result = build_eval_set(str(tmp_path / "labels.csv"), str(tmp_path / "wds"))
    assert result.samples == {"test": 2, "train": 4} and result.classnames == ["cat", "dog"]
    assert [label for _, label in read_like_clip_benchmark(tmp_path / "wds", "train")] == [0, 0, 1, 1]


def test_a_manifest_row_outside_its_folder_is_refused(tmp_path):
    (tmp_path / "labels.csv").write_text("image,label\n../../etc/passwd,cat\n")
    with pytest.raises(ManifestError, match=r"row 1, column 'image': '\.\./\.\./etc/passwd' is outside"):
        build_eval_set(str(tmp_path / "labels.csv"), str(tmp_path / "wds"))


def test_an_unreadable_image_is_left_out_and_counted(folder, tmp_path):
    copy = tmp_path / "pets"
    (copy / "cat").mkdir(parents=True)
    (copy / "dog").mkdir()
    (copy / "cat" / "a.jpg").write_bytes(photo_bytes(1))
    (copy / "cat" / "b.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    (copy / "dog" / "a.jpg").write_bytes(photo_bytes(2))
    result = build_eval_set(str(copy), str(tmp_path / "wds"), split="val")
    assert result.samples == {"val": 2} and result.skipped == {"val": 1}


def test_class_names_that_do_not_fit_are_one_line(capsys, folder, tmp_path):
    names = tmp_path / "names.json"
    names.write_text(json.dumps({"classnames": ["cat", "dog"]}))
    assert main(["data", "eval-set", "--source", str(folder), "--output", str(tmp_path / "wds"), "--classnames",
                 str(names)]) == 2
    assert "lists 2 names, the source has 3 classes" in capsys.readouterr().err


def read_retrieval_like_clip_benchmark(output: Path, split: str) -> list[tuple[Image.Image, list[str]]]:
    """CLIP_benchmark's build_wds_dataset, as its builder reads a set whose dataset_type.txt says retrieval."""
    import webdataset as wds

    assert (output / "dataset_type.txt").read_text().strip().lower() == "retrieval"
    count = int((output / split / "nshards.txt").read_text())
    dataset = (wds.WebDataset(str(output / split / f"{{0..{count - 1}}}.tar"), nodesplitter=lambda src: src,
                              shardshuffle=False)
               .decode(wds.autodecode.ImageHandler("pil", extensions=["webp", "png", "jpg", "jpeg"]))
               .to_tuple(["webp", "png", "jpg", "jpeg"], "txt").map_tuple(None, str.splitlines))
    return list(dataset)


@pytest.fixture
def captions(tmp_path) -> Path:
    """Five photos; the second on two rows (two captions), one caption with a line break inside it."""
    (tmp_path / "images").mkdir()
    rows = ["image,caption"]
    for i in range(5):
        (tmp_path / "images" / f"{i}.jpg").write_bytes(photo_bytes(i))
        rows.append(f'images/{i}.jpg,"photo {i},\nseen from the left"' if i == 3 else f"images/{i}.jpg,photo {i}")
    rows.append("images/1.jpg,the second photo again")
    (tmp_path / "captions.csv").write_text("\n".join(rows) + "\n")
    return tmp_path / "captions.csv"


def test_a_captions_manifest_becomes_a_retrieval_set_clip_benchmark_reads(captions, tmp_path):
    out = tmp_path / "wds"
    result = build_eval_set(str(captions), str(out), kind="retrieval", shard_size=2)
    assert result.samples == {"test": 5} and result.captions == {"test": 6} and result.classnames == []
    assert not (out / "classnames.txt").exists() and (out / "test" / "nshards.txt").read_text() == "3\n"
    samples = read_retrieval_like_clip_benchmark(out, "test")
    assert [texts for _, texts in samples] == [["photo 0"], ["photo 1", "the second photo again"], ["photo 2"],
                                               ["photo 3, seen from the left"], ["photo 4"]]
    for i, (image, _) in enumerate(samples):
        assert image.convert("RGB").tobytes() == Image.open(captions.parent / "images" / f"{i}.jpg").convert(
            "RGB").tobytes()


def test_cloob_eval_retrieval_scores_the_retrieval_set_as_the_manifest(capsys, captions, tmp_path, weights):
    out = tmp_path / "wds"
    assert main(["data", "eval-set", "--source", str(captions), "--type", "retrieval", "--output", str(out)]) == 0
    assert "test: 5 images, 6 captions" in capsys.readouterr().out
    common = ["--architecture", "cloob-tiny", "--weights", str(weights), "--no-cache", "--no-progress"]
    assert main(["eval", "retrieval", "--data", str(out), "--output", str(tmp_path / "a"), *common]) == 0
    assert main(["eval", "retrieval", "--data", str(captions), "--output", str(tmp_path / "b"), *common]) == 0
    from_set = json.loads((tmp_path / "a" / "wds-test_zeroshot_retrieval.json").read_text())["metrics"]
    from_csv = json.loads((tmp_path / "b" / "captions_zeroshot_retrieval.json").read_text())["metrics"]
    assert from_set["captions"] == 6 and from_set == from_csv


def test_a_packaged_set_becomes_a_retrieval_set_with_each_images_caption(tmp_path):
    from cloob_core.data.packaged import load_packaged

    result = build_eval_set("fluent-emoji", str(tmp_path / "wds"), kind="retrieval")
    test = load_packaged("fluent-emoji", "test")
    assert result.samples["test"] == result.captions["test"] == len(test)
    assert [texts for _, texts in read_retrieval_like_clip_benchmark(tmp_path / "wds", "test")] == [
        [caption] for caption in test.captions]


def test_a_classification_set_says_so_over_an_earlier_retrieval_set(captions, folder, tmp_path):
    out = tmp_path / "wds"
    build_eval_set(str(captions), str(out), kind="retrieval")
    build_eval_set(str(folder), str(out))
    assert (out / "dataset_type.txt").read_text() == "classification\n"  # CLIP_benchmark reads cls again


@pytest.mark.parametrize(("argv", "message"), [
    (["--type", "retrieval"], "a retrieval set needs captions"),  # an image folder has none
    (["--type", "retrieval", "--classnames", "cifar10"], "--classnames is for a classification set"),
])
def test_a_retrieval_set_without_captions_is_one_line(capsys, folder, tmp_path, argv, message):
    assert main(["data", "eval-set", "--source", str(folder), "--output", str(tmp_path / "wds"), *argv]) == 2
    assert message in capsys.readouterr().err
