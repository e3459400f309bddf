"""The benefit of curation at this machine's scale (`cloob experiment curation`): a scorer trained on one half of
the packaged captioned training pairs scores the other half after the captions of ``noise`` of its pairs were
swapped among themselves; the top ``keep`` are kept. CLOOB then trains on that half as it is (noisy), curated,
and clean, for the same number of steps (the same samples seen, as DataComp compares filters), and each run is
measured on the held-out captioned test pairs. What the removal hit is compared with what was swapped: the
precision and recall of the swapped pairs' removal.

The three training sets and the scorer are built once in ``OUTPUT/data``; the runs are a grid (:mod:`grid`), so an
interrupted experiment resumes where it stopped.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cloob_core.config import CloobConfig, config_from_mapping
from cloob_core.experiments.grids import Grid
from cloob_core.io import write_json

log = logging.getLogger(__name__)
SOURCE = ("captioned", "train")
# The scorer is trained as the cells are (CLOOB); a CLIP scorer trained alike told the swapped pairs apart a little
# better and curated worse (docs/curation.md, "What curation wins back").
SCORER: tuple[str, ...] = ()
SUITE = {"captioned": {"source": "captioned", "tasks": ["retrieval"]}}  # the held-out test pairs: R@1, R@5


@dataclass(frozen=True)
class NoisyPools:
    """The experiment's training sets, and how well curation found the swapped pairs."""

    noisy: str
    curated: str
    clean: str
    swapped: int  # pairs of the noisy half whose caption was replaced by another
    removed: int
    precision: float  # of the removed pairs, the share that was swapped
    recall: float  # of the swapped pairs, the share removed

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _halves(frame: Any, noise: float, seed: int) -> tuple[Any, Any, Any, set[str]]:
    """The scorer's half, the clean half, the same half with ``noise`` of its captions swapped (a cycle over the
    chosen pairs: each takes the next one's caption), and the URLs of the pairs whose caption changed."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(frame))
    scorer_half, pool = frame.iloc[order[: len(frame) // 2]], frame.iloc[order[len(frame) // 2:]]
    chosen = rng.choice(len(pool), size=round(noise * len(pool)), replace=False)
    noisy = pool.copy()
    for column in ("caption", "captions"):
        values = noisy[column].tolist()
        taken = [values[i] for i in chosen]
        for i, value in zip(chosen, taken[1:] + taken[:1], strict=True):
            values[i] = value
        noisy[column] = values
    changed = {url for url, before, after in zip(pool["url"], pool["caption"], noisy["caption"], strict=True)
               if before != after}  # (two pairs may share a caption: swapping them changes nothing)
    return scorer_half, pool, noisy, changed


def _shards(frame: Any, output: Path, config: CloobConfig) -> str:
    from cloob_core.data.download import download
    from cloob_core.data.sources import packaged_source

    if not (output / "sizes.json").exists():
        output.parent.mkdir(parents=True, exist_ok=True)
        manifest = output.parent / f"{output.name}.parquet"
        frame.to_parquet(manifest, index=False)
        download(str(manifest), str(output), config, progress=False, source=packaged_source([SOURCE]))
    return str(output)


def prepare_pools(config: CloobConfig, folder: Path, noise: float = 0.3, keep: float = 0.7,
                  seed: int = 0) -> NoisyPools:
    """The scorer trained on one half, the other half noisy, clean and curated, in ``folder``."""
    from cloob_core.curation.curate import KEPT_FILE, curate
    from cloob_core.curation.score import ScoreRequest, score
    from cloob_core.data.sources import packaged_frame
    from cloob_core.model.source import ModelSource
    from cloob_core.training.loop import train

    frame, _ = packaged_frame(*SOURCE)
    scorer_half, clean, noisy, swapped = _halves(frame, noise, seed)
    shards = {name: _shards(part, folder / name, config)
              for name, part in (("scorer-half", scorer_half), ("clean", clean), ("noisy", noisy))}
    scorer = folder / "scorer"
    if not (scorer / "model").exists():
        train(config_from_mapping(config.model_dump(), [f"train.shards={shards['scorer-half']}", *SCORER]), scorer,
              progress=False)
    scores, curated = folder / "noisy-scores", folder / "curated"
    model = ModelSource(model=str(scorer / "model"))
    score(ScoreRequest(shards["noisy"], model, str(scores), progress=False))
    if not (curated / KEPT_FILE).exists():
        curate(shards["noisy"], str(scores), str(curated),
               config_from_mapping(config.model_dump(), [f"curation.top_fraction={keep}"]))
    removed = _removed_urls(curated, scores)
    hit = len(removed & swapped)
    pools = NoisyPools(shards["noisy"], str(curated), shards["clean"], len(swapped), len(removed),
                       hit / len(removed) if removed else math.nan, hit / len(swapped) if swapped else math.nan)
    write_json(folder / "curation.json", pools.as_dict())
    return pools


def _removed_urls(curated: Path, scores: Path) -> set[str]:
    """The URLs of the samples the curation removed: the kept table's keys joined with the score table's URLs."""
    import pyarrow.parquet as pq

    from cloob_core.curation.curate import KEPT_FILE

    kept = pq.read_table(curated / KEPT_FILE, columns=["shard", "position", "kept"]).to_pylist()
    removed = {(row["shard"], row["position"]) for row in kept if not row["kept"]}
    table = [row for part in sorted((scores / "parts").glob("*.parquet"))
             for row in pq.read_table(part, columns=["shard", "position", "url"]).to_pylist()]
    return {row["url"] for row in table if (row["shard"], row["position"]) in removed}


def curation_grid(config: CloobConfig, output: Path) -> tuple[CloobConfig, Grid]:
    """The experiment's base configuration (the suite: the held-out captioned pairs' retrieval; the steps: the
    noisy half's, for every cell) and its grid of three training sets."""
    from cloob_core.data.shard_files import shard_list
    from cloob_core.training.loop import plan_steps

    mapping = config.model_dump()
    mapping["eval"]["datasets"] = SUITE
    mapping["eval"]["aggregates"] = {name: value for name, value in mapping["eval"]["aggregates"].items()
                                     if name.startswith("retrieval")}
    mapping["promote"]["guards"] = {}  # (they name the default suite's aggregates; the experiment promotes nothing)
    base = config_from_mapping(mapping)
    pools = prepare_pools(base, output / "data")
    steps = plan_steps(config_from_mapping(base.model_dump(), [f"train.shards={pools.noisy}"]),
                       shard_list(pools.noisy)[1])
    base = config_from_mapping(base.model_dump(), [f"train.steps={steps}"])
    log.info("swapped %d pairs; the curation removed %d: precision %.2f, recall %.2f", pools.swapped, pools.removed,
             pools.precision, pools.recall)
    return base, Grid("curation", "CLOOB on the noisy half, the curated half and the clean half",
                      {name: (f"train.shards={location}",) for name, location in
                       (("noisy", pools.noisy), ("curated", pools.curated), ("clean", pools.clean))})
