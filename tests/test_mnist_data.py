import hashlib
import re

import numpy as np
import pytest

from cloob_core.data import mnist


@pytest.fixture(scope="module")
def splits():
    return mnist.load_mnist("train"), mnist.load_mnist("test")


def test_split_sizes_and_balance(splits):
    train, test = splits
    assert len(train) == 4000 and len(test) == 1000
    assert np.bincount(test.labels, minlength=10).tolist() == [100] * 10
    assert np.bincount(train.labels, minlength=10).tolist() == [400] * 10


def test_held_out_images_never_appear_in_training(splits):
    train, test = splits
    digest = lambda image: hashlib.sha256(image.tobytes()).hexdigest()  # noqa: E731
    assert not {digest(i) for i in train.images} & {digest(i) for i in test.images}


def test_split_is_fixed(splits):
    again = mnist.load_mnist("test")
    assert np.array_equal(again.images, splits[1].images) and again.captions == splits[1].captions


def test_images_are_real_digits_not_noise(splits):
    train, _ = splits
    images = train.images.astype(np.float64) / 255
    assert train.images.shape[1:] == (28, 28) and train.images.dtype == np.uint8
    # MNIST: mostly black background, bright strokes, a 4-pixel nearly empty border, neighbouring pixels correlated
    assert 0.08 < images.mean() < 0.2
    assert (images == 0).mean() > 0.7
    border = np.concatenate([images[:, :2].ravel(), images[:, -2:].ravel(), images[:, :, :2].ravel()])
    assert border.mean() < 0.01 < images[:, 10:18, 10:18].mean()
    horizontal_corr = np.corrcoef(images[:, :, :-1].ravel(), images[:, :, 1:].ravel())[0, 1]
    assert horizontal_corr > 0.7


def test_captions_name_the_label_in_varied_phrasings(splits):
    train, _ = splits
    for label, caption in zip(train.labels, train.captions, strict=True):
        assert re.search(rf"\b({label}|{mnist.NUMBER_WORDS[label]})\b", caption), caption
    pairs = list(zip(train.captions, train.labels, strict=True))
    per_class_variety = [len({caption for caption, lab in pairs if lab == k}) for k in range(10)]
    assert min(per_class_variety) == len(mnist.CAPTION_TEMPLATES)


def test_zero_shot_prompts_are_not_training_captions(splits):
    train, _ = splits
    prompts = {t.format(name) for t in mnist.ZERO_SHOT_TEMPLATES for name in mnist.CLASSNAMES}
    assert not prompts & set(train.captions)


def test_unknown_split():
    with pytest.raises(ValueError, match="split"):
        mnist.load_mnist("validation")
