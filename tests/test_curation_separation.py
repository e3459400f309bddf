"""The scorer's separation on a pool (curation/separation.py): the ROC AUC of each sample's caption against another
sample's, from the stored embeddings. Checked against scikit-learn's AUC on the same pairs, at its bounds (a scorer
that matches every caption exactly, one that knows nothing), and end to end: a scorer at chance on a crawl unlike
the packaged set is named near chance by curate and refused by the shard gate when its scores made the cut."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from crawl import crawl_samples, write_tar

from cloob_core.curation import separation
from cloob_core.curation.score_table import PartRows


def cli(capsys, *argv) -> SimpleNamespace:
    """``cloob ARGV`` in this process: its exit status and what it printed."""
    from cloob_core.cli import main

    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return SimpleNamespace(code=code, out=captured.out, err=captured.err)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _pool(monkeypatch, parts: list[tuple[np.ndarray, np.ndarray]]):
    """A pool whose parts hold these (image, text) embeddings, as read_part_rows gives them."""
    rows = {f"{i:05d}": PartRows(f"{i:05d}", np.arange(len(image), dtype=np.int32),
                                 np.einsum("ij,ij->i", image, text).astype(np.float32), image.astype(np.float16),
                                 text.astype(np.float16)) for i, (image, text) in enumerate(parts)}
    monkeypatch.setattr(separation, "read_part_rows", lambda scores, part, width: rows[part.name])
    records = [SimpleNamespace(name=name, rows=len(part.positions)) for name, part in rows.items()]
    return SimpleNamespace(index=SimpleNamespace(parts=records, embedding_width=parts[0][0].shape[1]), scores="s")


def _embeddings(rng: np.random.Generator, rows: int, noise: float, width: int = 32):
    image = _unit(rng.standard_normal((rows, width)))
    return image, _unit(image + noise * rng.standard_normal((rows, width)))


def test_the_auc_of_two_histograms_is_scikit_learns_auc_of_the_values():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    positive, negative = np.tanh(rng.normal(0.3, 0.2, 5_000)), np.tanh(rng.normal(0.1, 0.25, 7_000))
    expected = roc_auc_score(np.r_[np.ones(5_000), np.zeros(7_000)], np.r_[positive, negative])
    found = separation.auc_of_histograms(separation._histogram(positive), separation._histogram(negative))
    assert found == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("noise, low, high", [(0.0, 0.999, 1.0), (0.8, 0.7, 0.95), (50.0, 0.45, 0.55)])
def test_the_separation_spans_a_perfect_scorer_to_one_at_chance(monkeypatch, noise, low, high):
    """Captions as the image (a perfect scorer), near it, and independent of it (a scorer at chance), over parts
    of unequal sizes; the mismatched pairs are scikit-learn's check too."""
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(1)
    parts = [_embeddings(rng, rows, noise) for rows in (300, 41, 1, 250)]
    found = separation.scorer_separation(_pool(monkeypatch, parts), seed=3)
    assert low <= found.auc <= high and found.pairs == 592
    assert found.near_chance == (noise > 10)
    images = np.concatenate([p[0] for p in parts])
    texts = np.concatenate([p[1] for p in parts])
    shuffled = texts[rng.permutation(len(texts))]
    matched, other = np.einsum("ij,ij->i", images, texts), np.einsum("ij,ij->i", images, shuffled)
    reference = roc_auc_score(np.r_[np.ones(len(matched)), np.zeros(len(other))], np.r_[matched, other])
    assert found.auc == pytest.approx(reference, abs=0.05)


def test_a_pool_of_one_part_pairs_within_it_and_one_sample_is_not_measured(monkeypatch):
    rng = np.random.default_rng(2)
    assert separation.scorer_separation(_pool(monkeypatch, [_embeddings(rng, 80, 0.0)]), seed=0).auc > 0.999
    alone = separation.scorer_separation(_pool(monkeypatch, [_embeddings(rng, 1, 0.0)]), seed=0)
    assert alone.auc is None and "not measured" in alone.line()


@pytest.fixture(scope="module")
def crawl_pool(tmp_path_factory, untrained_export):
    """Three shards of a crawl unlike the packaged set (drawn pictures, captions in several languages), scored by
    the untrained model: a scorer at chance."""
    from cloob_core.curation.score import ScoreRequest, score
    from cloob_core.model.source import ModelSource

    root = tmp_path_factory.mktemp("crawl")
    pool = root / "pool"
    pool.mkdir()
    for index in range(3):
        write_tar(pool / f"{index:05d}.tar", crawl_samples(40 * index, 40))
    score(ScoreRequest(str(pool), ModelSource(model=str(untrained_export), device="cpu"), str(root / "scores"),
                       workers=0, progress=False))
    return pool, root / "scores"


def test_a_scorer_at_chance_is_named_by_curate_and_its_cut_refused_by_the_shard_gate(crawl_pool, tmp_path, capsys):
    pool, scores = crawl_pool
    output = tmp_path / "curated"
    done = cli(capsys, "data", "curate", "--shards", pool, "--scores", scores, "--output", output, "--set",
               "curation.top_fraction=0.5")
    assert done.code == 0, done.err
    assert "near chance" in done.out and "warning: the scorer's separation" in done.out, done.out
    assert "curation.top_fraction is close to random" in done.out, done.out
    report = json.loads((output / "curation_report.json").read_text())
    assert 0.35 <= report["scorer_separation"]["auc"] <= 0.65 and report["scorer_separation"]["pairs"] == 120
    assert "near chance" in (output / "curation_report.md").read_text()
    gate = cli(capsys, "data", "validate", "--shards", output)
    assert gate.code == 1
    failing = [line for line in (gate.out + gate.err).splitlines() if "scorer_auc" in line]
    assert failing and "FAIL" in failing[0] and "curation.min_scorer_auc" in failing[0], gate.out + gate.err
    # the same scorer's cut without scores (a caption filter alone) is not judged by the scorer's separation
    words = tmp_path / "words"
    assert cli(capsys, "data", "curate", "--shards", pool, "--scores", scores, "--output", words, "--set",
               "curation.min_caption_words=2").code == 0
    assert cli(capsys, "data", "validate", "--shards", words).code == 0
