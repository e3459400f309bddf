"""What a person looks at before trusting a curation: the scores' histogram, kept against removed, and a contact
sheet of the samples at the cut, the lowest-scored kept beside the highest-scored removed."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image, ImageDraw

from cloob_core.curation.pool import SCORES_VIEW, ScoredPool, scored_samples
from cloob_core.curation.selection import REMOVED_TABLE
from cloob_core.evaluation.inputs import sample_image
from cloob_core.io import atomic_write
from cloob_core.plots import plt, save_png

BINS = 50
TILE = 160  # pixels per image on the contact sheet
CAPTION_LINES = 3


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


def _images(pool: ScoredPool, rows: list[tuple[str, int, str, str, float]]) -> dict[tuple[str, int], bytes]:
    """The image bytes of ``rows`` by shard and position, each source tar read once."""
    found: dict[tuple[str, int], bytes] = {}
    for shard in sorted({row[0] for row in rows}):
        positions = sorted({row[1] for row in rows if row[0] == shard})
        wanted = pool.connection.execute(
            f"SELECT position, key, sha256, caption FROM {SCORES_VIEW} WHERE shard = ? AND position IN "
            f"({', '.join(str(int(p)) for p in positions)}) ORDER BY position", [shard]).fetchall()
        table = [dict(zip(("position", "key", "sha256", "caption"), row, strict=True)) for row in wanted]
        for row, raw in scored_samples(pool, shard, table):
            found[shard, row["position"]] = sample_image(raw)
    return found


def _tile(image: bytes | None, caption: str, score: float) -> Image.Image:
    tile = Image.new("RGB", (TILE, TILE + 14 * (CAPTION_LINES + 1)), "white")
    if image is not None:
        picture = Image.open(io.BytesIO(image)).convert("RGB")
        picture.thumbnail((TILE, TILE))
        tile.paste(picture, ((TILE - picture.width) // 2, (TILE - picture.height) // 2))
    draw = ImageDraw.Draw(tile)
    words, lines = caption.split(), [""]
    for word in words:
        if len(lines[-1]) + len(word) + 1 > 26:
            lines.append("")
        lines[-1] = f"{lines[-1]} {word}".strip()
    text = [f"{score:.3f}", *lines[:CAPTION_LINES]]
    for number, line in enumerate(text):
        draw.text((4, TILE + 14 * number), line, fill="black")
    return tile


def contact_sheet_png(pool: ScoredPool, path: Path, count: int = 12) -> Path:
    """Two rows of ``count`` samples: the lowest-scored kept (top) and the highest-scored removed (bottom), each
    with its score and the start of its caption."""
    kept, removed = _rows(pool, True, count), _rows(pool, False, count)
    images = _images(pool, kept + removed)
    sheet = Image.new("RGB", (TILE * max(count, 1), 2 * (TILE + 14 * (CAPTION_LINES + 1))), "white")
    for row, chosen in enumerate((kept, removed)):
        for column, (shard, position, _, caption, score) in enumerate(chosen):
            sheet.paste(_tile(images.get((shard, position)), caption, score),
                        (column * TILE, row * (TILE + 14 * (CAPTION_LINES + 1))))
    return atomic_write(path, lambda tmp: sheet.save(tmp, format="PNG"))
