"""The curation report's sheets (issue 79, point 7): a sheet per filter of what it removed, each image with the
filter's evidence; as many images as curation.report_images; captions drawn in a font that has their characters,
and a note where no font here has them (empty boxes are not a caption)."""

from __future__ import annotations

import json

import pytest
from crawl import CAPTIONS, crawl_samples, write_tar
from PIL import Image

from cloob_core.config import load_config
from cloob_core.curation import lettering
from cloob_core.curation.curate import CONTACT_SHEET, REPORT_JSON, REPORT_MD, curate, removed_sheet
from cloob_core.curation.figures import SHEET_COLUMNS, TILE
from cloob_core.curation.score import ScoreRequest, score
from cloob_core.model.source import ModelSource

HAN = "一只绿色的三角形。赤い丸蜥蜴"


def _font_with(path, text: str) -> str:
    """A TrueType font of a square glyph for each character of ``text`` (and the space): a font of the script
    that this machine may not have."""
    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.ttGlyphPen import TTGlyphPen

    names = [".notdef", "space", *(f"uni{ord(c):04X}" for c in dict.fromkeys(text))]
    builder = FontBuilder(1000, isTTF=True)
    builder.setupGlyphOrder(names)
    builder.setupCharacterMap({32: "space", **{ord(c): f"uni{ord(c):04X}" for c in text}})
    glyphs = {}
    for name in names:
        pen = TTGlyphPen(None)
        if name not in (".notdef", "space"):
            pen.moveTo((100, 0)), pen.lineTo((100, 800)), pen.lineTo((900, 800)), pen.lineTo((900, 0))
            pen.closePath()
        glyphs[name] = pen.glyph()
    builder.setupGlyf(glyphs)
    builder.setupHorizontalMetrics({name: (1000, 0) for name in names})
    builder.setupHorizontalHeader(ascent=800, descent=-200)
    builder.setupNameTable({"familyName": "Squares", "styleName": "Regular"})
    builder.setupOS2()
    builder.setupPost()
    builder.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def pool(untrained_export, tmp_path_factory):
    root = tmp_path_factory.mktemp("sheets")
    (root / "pool").mkdir()
    write_tar(root / "pool" / "00000.tar", crawl_samples(0, 48))
    score(ScoreRequest(str(root / "pool"), ModelSource(model=str(untrained_export), device="cpu"),
                       str(root / "scores"), workers=0, progress=False))
    return root


def _curate(pool, output, *settings: str):
    return curate(str(pool / "pool"), str(pool / "scores"), str(output),
                  load_config(overrides=["curation.top_fraction=0.8", "curation.min_caption_words=2",
                                         "curation.min_scorer_auc=0", *settings]))


def test_each_filter_has_a_sheet_of_what_it_removed_as_many_as_the_setting(pool, tmp_path, monkeypatch):
    dejavu = lettering.font_files()[0]
    monkeypatch.setattr(lettering, "font_files", lambda: (dejavu,))
    result = _curate(pool, tmp_path / "o", "curation.report_images=6")
    report = json.loads((tmp_path / "o" / REPORT_JSON).read_text())
    assert report["sheets"] == {"cut": CONTACT_SHEET, **{reason: removed_sheet(reason)
                                                         for reason in ("min_caption_words", "top_fraction")}}
    for reason in ("min_caption_words", "top_fraction"):
        shown = min(6, result.selection.removed_by[reason])
        with Image.open(tmp_path / "o" / removed_sheet(reason)) as sheet:
            assert sheet.width == TILE * min(shown, SHEET_COLUMNS)
        assert f"![removed by {reason}]({removed_sheet(reason)})" in (tmp_path / "o" / REPORT_MD).read_text()
    with Image.open(tmp_path / "o" / CONTACT_SHEET) as sheet:
        assert sheet.width == TILE * 3  # 6 images: three kept above three removed
    # the Chinese and Japanese captions, with DejaVu Sans alone: boxes, and the report says so
    assert report["undrawn_lines"] > 0
    assert "in a script no font here covers" in (tmp_path / "o" / REPORT_MD).read_text()


def test_a_caption_is_drawn_in_a_font_that_has_its_characters(pool, tmp_path, monkeypatch):
    squares = _font_with(tmp_path / "squares.ttf", HAN)
    dejavu = lettering.font_files()[0]
    monkeypatch.setattr(lettering, "font_files", lambda: (dejavu, squares))
    assert lettering.font_for("Ein roter Kreis.")[0].path == dejavu
    font, covered = lettering.font_for("一只绿色的三角形。")
    assert covered and font.path == squares
    assert lettering.font_for("Кошка") == (lettering.font_for("a")[0], True)  # DejaVu has Cyrillic
    assert lettering.font_for("ไก่")[1] is False  # Thai: neither has it
    _curate(pool, tmp_path / "o", "curation.report_images=48")
    assert json.loads((tmp_path / "o" / REPORT_JSON).read_text())["undrawn_lines"] == 0
    assert set(CAPTIONS) >= {"一只绿色的三角形。", "赤い丸"}
