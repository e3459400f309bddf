"""Regenerate cloob_core/data/captioned/: the embedded set of real image-caption pairs, built from three packages
of the Debian and npm registries (the only real captioned images this project can fetch offline).

- Debian ``tuxpaint-stamps-default`` (GPL-2): object photographs and drawings, each with the one-sentence English
  description Tux Paint speaks (``<name>.txt``, first line), outside ``symbols/`` (letters, sign language, money,
  music). Category: the stamp's top-level folder (animals, food, vehicles, ...).
- npm ``@lobehub/fluent-emoji-3d`` (MIT; Microsoft's Fluent Emoji, MIT) with npm ``emojibase-data`` (MIT): 3-D
  renders of objects, animals, food, people and places, captioned with the emoji's Unicode name; its keywords are
  kept beside it. No skin-tone variants, no ``component`` emoji. Category: the Unicode group.

Images are composited on white, shrunk to 128 px on the shorter side (never enlarged) and stored as JPEG. A fifth
of the captions of each (source, category), with all their images, are held out (``split`` test): a held-out
caption is never trained on. Identical images are kept once. Run from the repository root, with apt-get and npm
on the path and cairosvg installed for the SVG-only stamps (``pip install cairosvg``):

    .venv/bin/python scripts/build_captioned_set.py [--cache DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cloob_core.config import PreprocessConfig  # noqa: E402
from cloob_core.data.imaging import process_image  # noqa: E402

OUT = ROOT / "cloob_core" / "data" / "captioned"
# (registry, package, version, sha256 of the fetched archive): a changed archive stops the build.
TUXPAINT = ("deb", "tuxpaint-stamps-default", "2022.06.04-1",
            "6db6c1bfc870a47f1499d6203b083522eacb57c5f9c87d468f2e92eb6d9d5f34")
FLUENT = ("npm", "@lobehub/fluent-emoji-3d", "1.1.0",
          "c1bb7eee7de090205a232518a9ab4adb3df458bfbe8a1f78232991194c8b2e58")
EMOJIBASE = ("npm", "emojibase-data", "17.0.0", "d01d0e2ca4e22cb402679532155342c71e2e871f25c32223c013b8b166ebdf5a")
STAMPS = "usr/share/tuxpaint/stamps"
LEFT_OUT_FOLDERS = ("symbols",)
LEFT_OUT_GROUPS = ("component",)
IMAGE = PreprocessConfig(image_size=128, resize_mode="keep_ratio", resize_only_if_bigger=True, jpeg_quality=90)
HELD_OUT = 0.2
SPLIT_SEED = 17


def fetch(spec: tuple[str, str, str, str], cache: Path) -> Path:
    """The package's archive in ``cache`` (fetched once), checked against its pinned digest."""
    registry, name, version, digest = spec
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"{name.lstrip('@').replace('/', '-')}*{version}*"))
    if not found:
        if registry == "deb":
            subprocess.run(["apt-get", "download", f"{name}={version}"], cwd=cache, check=True)
        else:
            subprocess.run(["npm", "pack", f"{name}@{version}"], cwd=cache, check=True, capture_output=True)
        found = sorted(cache.glob(f"{name.lstrip('@').replace('/', '-')}*{version}*"))
    archive = found[0]
    actual = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest and actual != digest:
        sys.exit(f"{archive.name}: sha256 {actual}, expected {digest}; delete it to fetch again")
    print(f"{archive.name}: sha256 {actual}")
    return archive


def unpack(archive: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    if archive.suffix == ".deb":
        subprocess.run(["dpkg-deb", "-x", str(archive), str(into)], check=True)
        return into
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "package"


_ENTITY = re.compile(r'<!ENTITY\s+(\w+)\s+"([^"]*)"\s*>')


def render_svg(path: Path) -> bytes:
    """The SVG as PNG. Illustrator's files declare namespace entities in a DOCTYPE, which cairosvg's XML parser
    (rightly) refuses; the internal ones are expanded here and the DOCTYPE dropped, so nothing external is read."""
    try:
        import cairosvg
    except ImportError:
        sys.exit("the SVG-only stamps need cairosvg: pip install cairosvg")
    text = path.read_text("utf-8", errors="replace")
    for name, value in _ENTITY.findall(text):
        text = text.replace(f"&{name};", value)
    text = re.sub(r"<!DOCTYPE[^\[>]*(\[.*?\])?\s*>", "", text, flags=re.DOTALL)
    return cairosvg.svg2png(bytestring=text.encode("utf-8"), output_width=256)


def tuxpaint_pairs(tree: Path) -> list[dict]:
    stamps = tree / STAMPS
    pairs = []
    for text in sorted(stamps.rglob("*.txt")):
        relative = text.relative_to(stamps)
        if relative.parts[0] in LEFT_OUT_FOLDERS:
            continue
        lines = text.read_text("utf-8", errors="replace").splitlines()
        caption = lines[0].strip() if lines else ""
        png, svg = text.with_suffix(".png"), text.with_suffix(".svg")
        if not caption or not (png.exists() or svg.exists()):
            continue
        data = png.read_bytes() if png.exists() else render_svg(svg)
        pairs.append({"key": "tuxpaint/" + relative.with_suffix("").as_posix(), "source": "tuxpaint",
                      "caption": caption, "keywords": [], "category": relative.parts[0],
                      "subcategory": "/".join(relative.parts[:-1]), "raw": data})
    return pairs


def emoji_pairs(fluent: Path, emojibase: Path) -> list[dict]:
    def bare(hexcode: str) -> str:
        return hexcode.lower().replace("-fe0f", "")

    assets = {bare(path.stem): path for path in (fluent / "assets").glob("*.webp")}
    messages = json.loads((emojibase / "en" / "messages.json").read_text("utf-8"))
    groups = {g["order"]: (g["key"], g["message"]) for g in messages["groups"]}
    subgroups = {g["order"]: g["message"] for g in messages["subgroups"]}
    pairs = []
    for entry in json.loads((emojibase / "en" / "data.json").read_text("utf-8")):
        image = assets.get(bare(entry["hexcode"]))
        if image is None or "group" not in entry or groups[entry["group"]][0] in LEFT_OUT_GROUPS:
            continue
        pairs.append({"key": f"fluent-emoji/{entry['hexcode'].lower()}", "source": "fluent-emoji",
                      "caption": entry["label"], "keywords": list(entry.get("tags", [])),
                      "category": groups[entry["group"]][1], "subcategory": subgroups.get(entry.get("subgroup"), ""),
                      "raw": image.read_bytes()})
    return pairs


def encode(pairs: list[dict]) -> list[dict]:
    """Each pair's image as a small JPEG; pairs whose image does not decode, or repeats an earlier one, dropped."""
    kept, seen = [], set()
    for pair in pairs:
        processed = process_image(pair.pop("raw"), IMAGE)
        if processed.jpeg is None:
            print(f"dropped {pair['key']}: {processed.reason} {processed.detail}")
            continue
        digest = hashlib.sha256(processed.jpeg).hexdigest()
        if digest in seen:
            print(f"dropped {pair['key']}: the same image as an earlier pair")
            continue
        seen.add(digest)
        kept.append({**pair, "image": processed.jpeg, "width": processed.width, "height": processed.height})
    return kept


def assign_splits(frame: pd.DataFrame) -> pd.Series:
    """Held out: about HELD_OUT of the distinct captions of each (source, category), drawn with a fixed seed,
    with every image that carries them."""
    rng = np.random.default_rng(SPLIT_SEED)
    held: set[tuple[str, str]] = set()
    for (source, _), captions in frame.groupby(["source", "category"], sort=True)["caption"]:
        distinct = sorted(set(captions))
        held.update((source, c) for c in rng.choice(distinct, size=round(HELD_OUT * len(distinct)), replace=False))
    return pd.Series(["test" if (s, c) in held else "train" for s, c in zip(frame["source"], frame["caption"],
                                                                              strict=True)], index=frame.index)


def licences(tux: Path, fluent: Path, emojibase: Path, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tux / "usr/share/doc/tuxpaint-stamps-default/copyright", into / "tuxpaint-stamps.copyright")
    shutil.copyfile("/usr/share/common-licenses/GPL-2", into / "GPL-2.txt")
    shutil.copyfile(emojibase / "LICENSE", into / "emojibase-data.LICENSE")
    manifest = json.loads((fluent / "package.json").read_text("utf-8"))
    mit = (emojibase / "LICENSE").read_text("utf-8")  # the MIT licence's terms, the same for every holder
    (into / "fluent-emoji-3d.LICENSE").write_text(
        f"{manifest['name']} {manifest['version']}: licence field of its package.json: {manifest['license']}.\n"
        "Its README: \"Copyright © 2023 LobeHub. This project is MIT licensed.\" The artwork is Microsoft's Fluent\n"
        "Emoji (https://github.com/microsoft/fluentui-emoji), MIT licensed, Copyright (c) Microsoft Corporation.\n\n"
        + mit[mit.index("Permission is hereby granted"):], encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "cloob-captioned-sources",
                        help="where the fetched archives are kept between runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tux = unpack(fetch(TUXPAINT, args.cache), Path(tmp) / "tux")
        fluent = unpack(fetch(FLUENT, args.cache), Path(tmp) / "fluent")
        emojibase = unpack(fetch(EMOJIBASE, args.cache), Path(tmp) / "emojibase")
        frame = pd.DataFrame(encode(tuxpaint_pairs(tux) + emoji_pairs(fluent, emojibase)))
        licences(tux, fluent, emojibase, OUT / "LICENSES")
    frame.insert(2, "split", assign_splits(frame))
    OUT.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False, compression="zstd")
    (OUT / "pairs.parquet").write_bytes(buffer.getvalue())
    counts = frame.groupby(["source", "split"]).size().unstack(fill_value=0)
    print(counts.to_string())
    print(f"{len(frame)} pairs, {frame['caption'].nunique()} distinct captions, "
          f"{len(buffer.getvalue()) / 1e6:.1f} MB -> {OUT / 'pairs.parquet'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
