"""Decoding at the scale the output needs: the one decode path of the download stage's resizer and of training's
input.

A JPEG decodes at 1/2, 1/4 or 1/8 of its size in the DCT domain (libjpeg-turbo's scaled inverse DCT, through
Pillow's ``draft``), which skips most of the inverse transform and colour conversion. The reduction taken is the
largest whose scale is still at least the output's: ``k <= width / need`` on both sides, so no detail the output
can hold is lost. This is Pillow's own rule for a whole-pixel need; the download stage gives the unrounded target
(``width x scale``), so that the odd side of an exact 2:1 shrink (703 px to 351.5, stored as 352) reduces too,
where the rounded target made Pillow decode a quarter of such sources in full. The huffman decoding is not
reduced, so the saving is about a fifth at 1/2 and a half at 1/8 (docs/performance.md, "Download throughput").

At k = 8 each decoded pixel is its 8 x 8 block's mean; at 2 and 4 the low-frequency coefficients' inverse
transform. Against a full decode reduced by integer block means both agree to 53-56 dB (luma, aligned crops).
"""

from __future__ import annotations

from PIL import Image

REDUCTIONS = (8, 4, 2)  # libjpeg-turbo's scaling factors below 1 that Pillow's draft reaches


def reduction(width: int, height: int, need_width: float, need_height: float) -> int:
    """The largest k of 8, 4, 2 (else 1) with ``k x need <= size`` on both sides: the reduced image's scale,
    ``1 / k``, is still at least the output's."""
    for k in REDUCTIONS:
        if k * need_width <= width and k * need_height <= height:
            return k
    return 1


def decode_reduced(image: Image.Image, need_width: float, need_height: float) -> tuple[float, float, float, float]:
    """Load ``image`` (opened, not yet loaded), a JPEG at the largest reduction the need allows (in the stored
    orientation); returns where the whole original lies in the decoded pixels, ``(0, 0, width / k,
    height / k)``: the box that maps a resize or crop of the original onto them."""
    width, height = image.size
    box = (0.0, 0.0, float(width), float(height))
    k = reduction(width, height, need_width, need_height) if image.format == "JPEG" else 1
    if k > 1:
        drafted = image.draft("RGB", (width // k, height // k))  # Pillow's rule takes exactly k for this request
        box = drafted[1] if drafted is not None else box
    image.load()
    return box
