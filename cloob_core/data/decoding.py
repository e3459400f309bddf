"""Decoding at the scale the output needs: the one decode path of the download stage's resizer and of training's
input.

A JPEG decodes at 1/2, 1/4 or 1/8 of its size in the DCT domain (libjpeg-turbo's scaled inverse DCT, through
Pillow's ``draft``), which skips most of the inverse transform and colour conversion. The reduction taken is the
largest whose decoded image (each side rounded up, as libjpeg rounds) still covers the size the caller needs, so
no pixel the output needs is lost; Pillow's own rule (``draft`` with the needed size) rounds down and decodes at
full size whenever a side needs one pixel more than the reduced side's floor, a quarter of web images at an exact
2:1 ratio. The huffman decoding is not reduced, so the saving is about a quarter at 1/2 and a half at 1/8 (docs/
performance.md, "Decoding at the scale the output needs").

At k = 8 each decoded pixel is its 8 x 8 block's mean; at 2 and 4 the low-frequency coefficients' inverse
transform. Against a full decode reduced by integer block means both agree to 53-56 dB (luma, aligned crops).
"""

from __future__ import annotations

from PIL import Image

REDUCTIONS = (8, 4, 2)  # libjpeg-turbo's scaling factors below 1 that Pillow's draft reaches


def reduction(width: int, height: int, need_width: float, need_height: float) -> int:
    """The largest k of 8, 4, 2 (else 1) whose decoded ``ceil(width / k)`` x ``ceil(height / k)`` covers
    ``need_width`` x ``need_height``."""
    for k in REDUCTIONS:
        if k <= min(width, height) and -(-width // k) >= need_width and -(-height // k) >= need_height:
            return k
    return 1


def decode_reduced(image: Image.Image, need_width: float, need_height: float) -> tuple[float, float, float, float]:
    """Load ``image`` (opened, not yet loaded), a JPEG at the largest reduction that still covers the need (in the
    stored orientation); returns where the whole original lies in the decoded pixels, ``(0, 0, width / k,
    height / k)``: the box that maps a resize or crop of the original onto them."""
    width, height = image.size
    box = (0.0, 0.0, float(width), float(height))
    k = reduction(width, height, need_width, need_height) if image.format == "JPEG" else 1
    if k > 1:
        drafted = image.draft("RGB", (width // k, height // k))  # Pillow's rule takes exactly k for this request
        box = drafted[1] if drafted is not None else box
    image.load()
    return box
