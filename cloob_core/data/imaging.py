"""The resizer: bytes in, a checked, oriented, RGB, resized JPEG out, or the reason it was dropped.

The pixel count is checked from the header, before any pixel is decoded, so a decompression bomb costs
nothing. A JPEG is decoded at the DCT scale its target needs (``decoding.decode_reduced``); what that leaves, a
shrink of less than 2x, is resampled with Pillow's antialiased bicubic onto the original's exact geometry (as
Pillow's ``thumbnail`` does after its ``draft``). Other images, and JPEGs decoded at full size, shrink by area
averaging (``BOX``, OpenCV's ``INTER_AREA`` in img2dataset), which suits any ratio from the full image. Where
the time goes and how far the result is from a full decode: docs/performance.md.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from cloob_core.config import PreprocessConfig
from cloob_core.data.decoding import decode_reduced


@dataclass
class ProcessedImage:
    jpeg: bytes | None
    reason: str | None = None
    detail: str = ""
    original_width: int = 0
    original_height: int = 0
    width: int = 0
    height: int = 0


def _drop(reason: str, detail: str, width: int = 0, height: int = 0) -> ProcessedImage:
    return ProcessedImage(None, reason, detail, width, height)


def target_scale(width: int, height: int, config: PreprocessConfig) -> float:
    """The resize's scale, before a crop or border: the side that must reach ``image_size`` does (not by
    enlarging, under ``resize_only_if_bigger``), and no side is longer than ``max_side``."""
    scale = 1.0
    if config.resize_mode != "no":
        reference = max(width, height) if config.resize_mode == "border" else min(width, height)
        if not (config.resize_only_if_bigger and reference <= config.image_size):
            scale = config.image_size / reference
    if config.max_side is not None and max(width, height) * scale > config.max_side:
        scale = config.max_side / max(width, height)
    return scale


def target_size(width: int, height: int, config: PreprocessConfig) -> tuple[int, int]:
    """The size after resizing (:func:`target_scale`), in whole pixels."""
    scale = target_scale(width, height, config)
    if scale == 1.0:
        return width, height
    return max(1, round(width * scale)), max(1, round(height * scale))


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        image = image.point(lambda v: v / 256).convert("L")
    return image.convert("RGB")


def process_image(data: bytes, config: PreprocessConfig, reduced_decode: bool = True) -> ProcessedImage:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as err:
            return _drop("decompression_bomb", str(err))
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
            return _drop("decode_error", f"not a readable image: {err}")
        width, height = image.size
        if width * height > config.max_image_pixels:
            return _drop("decompression_bomb", f"{width}x{height} pixels > {config.max_image_pixels}", width, height)
        if width < 1 or height < 1:
            return _drop("decode_error", f"empty image {width}x{height}")
        try:
            # EXIF orientation may swap the sides; read it before checking sizes.
            orientation = image.getexif().get(0x0112, 1)
            if orientation in (5, 6, 7, 8):
                width, height = height, width
            if min(width, height) < config.min_image_side:
                return _drop("too_small", f"{width}x{height}, shorter side < {config.min_image_side}", width, height)
            ratio = max(width, height) / min(width, height)
            if config.max_aspect_ratio is not None and ratio > config.max_aspect_ratio:
                return _drop("aspect_ratio", f"{width}x{height}, ratio {ratio:.2f} > {config.max_aspect_ratio:g}",
                             width, height)
            new_w, new_h = target_size(width, height, config)
            stored = image.size
            scale = target_scale(width, height, config) if reduced_decode else 1.0
            box = decode_reduced(image, stored[0] * scale, stored[1] * scale)  # the unrounded target
            if image.size != stored:  # decoded reduced: onto the target's exact geometry, in the stored orientation
                size = (new_h, new_w) if orientation in (5, 6, 7, 8) else (new_w, new_h)
                image = image.resize(size, Image.Resampling.BICUBIC, box=box)
            ImageOps.exif_transpose(image, in_place=True)  # in place: no copy of an image already upright
            image = _to_rgb(image)
        except Image.DecompressionBombError as err:
            return _drop("decompression_bomb", str(err), width, height)
        except (OSError, ValueError, SyntaxError) as err:
            return _drop("decode_error", f"image does not decode: {err}", width, height)
    image = _resize(image, new_w, new_h, config)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=config.jpeg_quality)
    return ProcessedImage(jpeg=out.getvalue(), reason=None, detail="", original_width=width,
                          original_height=height, width=image.width, height=image.height)


def full_decode_reference(data: bytes, config: PreprocessConfig) -> bytes | None:
    """The stored JPEG a full decode gives: what reduced decoding is measured against (tests, benchmarks)."""
    return process_image(data, config, reduced_decode=False).jpeg


def _resize(image: Image.Image, new_w: int, new_h: int, config: PreprocessConfig) -> Image.Image:
    if image.size != (new_w, new_h):
        # Area averaging to shrink (aliasing-free, as OpenCV's INTER_AREA that img2dataset uses), Lanczos to
        # enlarge (img2dataset: LANCZOS4).
        shrinking = new_w * new_h < image.width * image.height
        image = image.resize((new_w, new_h), Image.Resampling.BOX if shrinking else Image.Resampling.LANCZOS)
    size = config.image_size
    if config.resize_mode == "center_crop":
        side = min(size, image.width, image.height)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        image = image.crop((left, top, left + side, top + side))
    elif config.resize_mode == "border":
        side = max(size, image.width, image.height)
        canvas = Image.new("RGB", (side, side), (0, 0, 0))
        canvas.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        image = canvas
    return image


def caption_refusal(caption: str, config: PreprocessConfig) -> tuple[str, str] | None:
    """(reason, detail) when the caption fails the filters, else None."""
    text = caption.strip()
    if not text:
        return ("empty_caption", "caption is empty") if config.min_caption_chars > 0 else None
    if len(text) < config.min_caption_chars:
        return "caption_too_short", f"{len(text)} chars < {config.min_caption_chars}"
    if config.max_caption_chars is not None and len(text) > config.max_caption_chars:
        return "caption_too_long", f"{len(text)} chars > {config.max_caption_chars}"
    return None
