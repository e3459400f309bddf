"""Text on the report's sheets in a font that has its characters: a crawl's captions are in many scripts, and
PIL's default font, or DejaVu Sans alone, draws a Chinese caption as empty boxes.

Each line is drawn in the first font that covers all of its characters: DejaVu Sans (matplotlib ships it, so it is
always there: Latin, Greek, Cyrillic, Arabic, Hebrew, Armenian, Georgian), then the system's fonts as matplotlib
finds them, read once per process for the characters they map. The pipeline's image installs Droid Sans Fallback
(Debian's ``fonts-droid-fallback``: Chinese, Japanese, Korean); elsewhere install a font of the script (Debian
``fonts-noto-cjk``). A line no font here covers is drawn in DejaVu Sans and counted, and the report says so.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from PIL import ImageFont

SIZE = 11  # pixels: three caption lines under a 160-pixel tile


@cache
def font_files() -> tuple[str, ...]:
    """The fonts a line may be drawn in, in order of preference."""
    import matplotlib
    from matplotlib import font_manager

    dejavu = str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf")
    others = sorted(path for path in font_manager.findSystemFonts() if Path(path).suffix.lower() in (".ttf", ".otf",
                                                                                                      ".ttc"))
    return (dejavu, *(path for path in others if path != dejavu))


@cache
def _characters(path: str) -> frozenset[int]:
    """The code points font ``path`` maps (its first face for a collection); none for a file that is not a font."""
    from fontTools.ttLib import TTFont

    try:
        with TTFont(path, fontNumber=0, lazy=True) as font:
            return frozenset((font.getBestCmap() or {}).keys())
    except Exception:  # whatever a broken or foreign font file raises: it draws nothing here
        return frozenset()


@cache
def _font(path: str) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(path, SIZE)


def font_for(text: str, files: tuple[str, ...] | None = None) -> tuple[ImageFont.FreeTypeFont, bool]:
    """The font to draw ``text`` in, and whether it has every character of it (else: DejaVu Sans, and False)."""
    files = files if files is not None else font_files()
    needed = {ord(character) for character in text if not character.isspace()}
    for path in files:
        if needed <= _characters(path):
            return _font(path), True
    return _font(files[0]), False
