"""What a person looks at before trusting a curation: the scores' histogram, kept against removed, a contact sheet
of the samples at the cut (the lowest-scored kept beside the highest-scored removed), and a sheet per filter of a
sample of what it removed, each with the filter's evidence under it. Text is drawn in a font that has its
characters (:mod:`cloob_core.curation.lettering`)."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image, ImageDraw

from cloob_core.curation.lettering import font_for
from cloob_core.curation.pool import SCORES_VIEW, ScoredPool, sample_images
from cloob_core.curation.selection import REMOVED_TABLE
from cloob_core.io import atomic_write
from cloob_core.plots import plt, save_png

BINS = 50
TILE = 160  # pixels per image on a sheet
LINE = 14  # pixels per line of text under it
TEXT_LINES = 4  # lines of evidence and caption under a tile
SHEET_COLUMNS = 8  # tiles per row of a filter's sheet


def score_histogram_png(pool: ScoredPool, path: Path) -> Path:
    """The image-text cosines of the kept and the removed samples, in ``BINS`` bins over their range (counted by
    the engine: nothing per sample is held)."""
    low, high = pool.connection.execute(
        f"SELECT min(clip_score), max(clip_score) FROM {SCORES_VIEW} WHERE NOT isnan(clip_score)").fetchone()
    low, high = (low or 0.0), (high or 0.0)
    width = (high - low) / BINS or 1.0
    counts = pool.connection.execute(
        f"""SELECT least(floor((s.clip_score - {low!r}) / {width!r}), {BINS - 1})::INTEGER AS bin,
                   r.shard IS NULL AS kept, count(*)
            FROM {SCORES_VIEW} s LEFT JOIN (SELECT DISTINCT shard, position FROM {REMOVED_TABLE}) r
            USING (shard, position) WHERE NOT isnan(s.clip_score) GROUP BY ALL ORDER BY ALL""").fetchall()
    kept, removed = [0] * BINS, [0] * BINS
    for index, is_kept, count in counts:
        (kept if is_kept else removed)[index] += count
    edges = [low + index * width for index in range(BINS)]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(edges, removed, width=width, align="edge", color="tab:red", alpha=0.6, label="removed")
    ax.bar(edges, kept, width=width, align="edge", bottom=removed, color="tab:green", alpha=0.7, label="kept")
    ax.set_xlabel("image-text cosine (clip_score)")
    ax.set_ylabel("samples")
    ax.legend()
    return save_png(fig, path, title="Scores of the pool: kept and removed")


def _rows(pool: ScoredPool, kept: bool, count: int) -> list[tuple[str, int, str, str, float]]:
    """The ``count`` lowest-scored kept samples, or highest-scored removed ones: shard, position, key, caption,
    score."""
    order, test = ("ASC", "IS NULL") if kept else ("DESC", "IS NOT NULL")
    return pool.connection.execute(
        f"""SELECT s.shard, s.position, s.key, s.caption, s.clip_score FROM {SCORES_VIEW} s
            LEFT JOIN (SELECT DISTINCT shard, position FROM {REMOVED_TABLE}) r USING (shard, position)
            WHERE r.shard {test} AND NOT isnan(s.clip_score)
            ORDER BY s.clip_score {order}, s.shard, s.position LIMIT {int(count)}""").fetchall()


def _images(pool: ScoredPool, places: list[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
    """The image bytes of the samples at ``places`` (shard, position), each source tar read once."""
    return {(shard, position): image for shard in sorted({shard for shard, _ in places})
            for position, image in sample_images(pool, shard, [p for name, p in places if name == shard]).items()}


def _wrapped(text: str, most: int, width: int = TILE - 8) -> list[str]:
    """The first ``most`` lines of ``text`` at most ``width`` pixels wide in the font it is drawn in (words kept
    whole where they fit; a script without spaces broken between characters)."""
    font = font_for(text)[0]
    lines = [""]
    for character in text:
        candidate = lines[-1] + character
        if font.getlength(candidate) <= width or not lines[-1]:
            lines[-1] = candidate
            continue
        if len(lines) == most:
            break
        cut = lines[-1].rfind(" ")
        if character.isspace() or cut <= 0:
            lines.append(character.strip())
        else:
            lines[-1], carried = lines[-1][:cut], lines[-1][cut + 1:]
            lines.append(carried + character)
    return [line for line in lines if line]


class Lettering:
    """Draws a tile's lines, each in a font that has its characters, counting those no font here covers."""

    def __init__(self) -> None:
        self.uncovered = 0

    def draw(self, draw: ImageDraw.ImageDraw, place: tuple[int, int], line: str, fill: str) -> None:
        font, covered = font_for(line)
        self.uncovered += not covered
        draw.text(place, line, fill=fill, font=font)


def _tile(image: bytes | None, texts: list[tuple[str, int, str]], lettering: Lettering) -> Image.Image:
    """An image with, under it, each of ``texts`` (text, most lines, colour) wrapped to the tile's width."""
    lines = [(line, colour) for text, most, colour in texts for line in _wrapped(text, most)]
    tile = Image.new("RGB", (TILE, TILE + LINE * (TEXT_LINES + 1)), "white")
    if image is not None:
        picture = Image.open(io.BytesIO(image)).convert("RGB")
        picture.thumbnail((TILE, TILE))
        tile.paste(picture, ((TILE - picture.width) // 2, (TILE - picture.height) // 2))
    draw = ImageDraw.Draw(tile)
    for number, (line, colour) in enumerate(lines[:TEXT_LINES + 1]):
        lettering.draw(draw, (4, TILE + LINE * number), line, colour)
    return tile


def _sheet(tiles: list[list[Image.Image]], columns: int) -> Image.Image:
    height = TILE + LINE * (TEXT_LINES + 1)
    sheet = Image.new("RGB", (TILE * max(columns, 1), height * max(len(tiles), 1)), "white")
    for row, chosen in enumerate(tiles):
        for column, tile in enumerate(chosen):
            sheet.paste(tile, (column * TILE, row * height))
    return sheet


def contact_sheet_png(pool: ScoredPool, path: Path, images: int = 24) -> int:
    """Two rows of ``images`` / 2 samples: the lowest-scored kept (top) and the highest-scored removed (bottom),
    each with its score and the start of its caption. Returns the lines no font here could draw."""
    count = max(1, images // 2)
    kept, removed = _rows(pool, True, count), _rows(pool, False, count)
    found = _images(pool, [(shard, position) for shard, position, *_ in kept + removed])
    lettering = Lettering()
    tiles = [[_tile(found.get((shard, position)), [(f"{score:.3f}", 1, "black"), (caption, TEXT_LINES, "black")],
                    lettering) for shard, position, _, caption, score in chosen] for chosen in (kept, removed)]
    atomic_write(path, lambda tmp: _sheet(tiles, count).save(tmp, format="PNG"))
    return lettering.uncovered


def removed_sheet_png(pool: ScoredPool, reason: str, path: Path, images: int = 24, seed: int = 0) -> int:
    """Up to ``images`` samples that the filter of ``reason`` removed, a seeded sample of them (the same pool, the
    same sheet), each with the filter's evidence (red) above its caption. Returns the lines no font here could
    draw."""
    rows = pool.connection.execute(
        f"""SELECT r.shard, r.position, r.evidence, s.caption FROM {REMOVED_TABLE} r JOIN {SCORES_VIEW} s
            USING (shard, position) WHERE r.reason = ? ORDER BY hash(r.shard, r.position, {int(seed)}), r.shard,
            r.position LIMIT {int(images)}""", [reason]).fetchall()
    found = _images(pool, [(shard, position) for shard, position, *_ in rows])
    lettering = Lettering()
    tiles = [_tile(found.get((shard, position)), [(evidence or reason, 2, "firebrick"), (caption, TEXT_LINES, "black")],
                   lettering) for shard, position, evidence, caption in rows]
    columns = min(len(tiles), SHEET_COLUMNS) or 1
    atomic_write(path, lambda tmp: _sheet([tiles[start:start + columns] for start in range(0, len(tiles), columns)],
                                          columns).save(tmp, format="PNG"))
    return lettering.uncovered
