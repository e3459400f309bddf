"""The curation section: which filters `cloob data curate` applies to a scored pool. Every filter is off unless
set; a sample is kept when every filter that is set keeps it."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from cloob_core.config.base import _Section


class CurationConfig(_Section):
    """Filters of `cloob data curate` over the scores `cloob data score` wrote (docs/curation.md)."""

    enabled: bool = Field(False, description="Run the DVC pipeline's score and curate stages and train on the "
                          "curated shards (false: train on the downloaded shards, as before).")
    scorer: str | None = Field(None, description="The model that scores the pool where no model is given on the "
                               "command line (the DVC pipeline's score stage, the Kubeflow run): a `cloob train` "
                               "model folder (local or s3://), production (promote.store's current model), or an "
                               "open_clip hf-hub:ORG/NAME or local-dir:PATH (a DFN or OpenAI CLIP; from the Hugging "
                               "Face cache where the network is closed).")
    min_clip_score: float | None = Field(None, ge=-1.0, le=1.0, description="Keep samples whose image-text cosine "
                                         "is at least this (LAION-5B: 0.28 with ViT-B/32); null: no floor.")
    top_fraction: float | None = Field(None, gt=0.0, le=1.0, description="Keep this fraction of the pool with the "
                                       "highest image-text cosine, over every part at once (DataComp: 0.3); ties "
                                       "are broken by shard and position. null: no cut.")
    min_scorer_auc: float = Field(0.6, ge=0.0, le=1.0, description="The scoring model's separation on the pool "
                                  "(the ROC AUC of each sample's caption against another sample's, the curation "
                                  "report's scorer_separation; 0.5 is chance) below which curate warns and the "
                                  "shard gate refuses shards cut by score (min_clip_score, top_fraction); 0: never.")
    languages: list[str] | None = Field(None, min_length=1, description="The languages wanted (fastText lid.176's "
                                        "ISO 639 codes: en, de, ...): a caption identified as another, with at "
                                        "least min_language_confidence, is removed; null: any.")
    min_language_confidence: float | None = Field(None, ge=0.0, le=1.0, description="With languages: remove a "
                                                  "caption identified as another language only when identified "
                                                  "with at least this confidence (null: 0, every one; 0.5 for "
                                                  "short captions: docs/curation.md).")
    min_caption_words: int | None = Field(None, ge=1, description="Keep captions of at least this many words "
                                          "(DataComp's basic filter: more than 2, i.e. 3).")
    min_image_side: int | None = Field(None, ge=1, description="Keep images whose stored shorter side is at least "
                                       "this (DataComp's basic filter: 200).")
    max_aspect_ratio: float | None = Field(None, ge=1.0, description="Keep images whose stored long/short side ratio "
                                           "is at most this (DataComp's basic filter: 3).")
    near_duplicates: bool = Field(False, description="Of images within near_duplicate_bits of each other by "
                                  "perceptual hash, keep the one with the highest image-text cosine.")
    near_duplicate_bits: int = Field(4, ge=0, le=16, description="The Hamming distance of two 64-bit perceptual "
                                     "hashes at or below which two images are near-duplicates (0: the same hash).")
    semantic_dedup_eps: float | None = Field(None, gt=0.0, lt=1.0, description="SemDeDup (Abbas et al. 2023): of "
                                             "images in one k-means cluster whose embeddings' cosine is above 1 - eps, "
                                             "keep the one with the highest image-text cosine (their LAION-440M "
                                             "runs: 0.03-0.07); null: off.")
    semantic_dedup_clusters: int | None = Field(None, ge=1, description="SemDeDup's k-means clusters (null: one per "
                                                "5,000 samples; they used 50,000 for 440M).")
    decontaminate: list[str] = Field([], description="Evaluation sets whose images are removed from the pool where "
                                     "a pool image copies one (a candidate by perceptual hash or by embedding, "
                                     "confirmed by its pixels): names of eval.datasets (their test split) or sets "
                                     "`cloob eval` reads. Needs the scoring model (`cloob data curate --model`).")
    decontaminate_bits: int = Field(6, ge=0, le=16, description="With decontaminate: a pool image within this "
                                    "many bits of an evaluation image's 64-bit perceptual hash is a candidate.")
    decontaminate_min_cosine: float = Field(0.95, ge=0.0, le=1.0, description="With decontaminate: a pool image "
                                            "whose embedding's cosine with an evaluation image's is at least this "
                                            "is a candidate.")
    decontaminate_min_similarity: float | None = Field(
        0.97, ge=-1.0, le=1.0, description="With decontaminate: a candidate whose pixels' similarity to the "
        "evaluation image (the best normalised cross-correlation of either, scaled to 80-100%, placed in the "
        "other; 1.0 is the same pixels) is at least this is removed as a copy; null: every candidate is removed, "
        "unchecked (what a hash or a cosine alone takes for a copy: docs/curation.md).")
    target_images: str | None = Field(None, description="DataComp's image-based filter: keep samples whose nearest "
                                      "k-means centroid of the pool's image embeddings is the nearest centroid of "
                                      "some image of this set (any set `cloob eval` reads: an ImageFolder, shards, "
                                      "a wds set); needs the scoring model. null: off.")
    target_split: str = Field("train", description="The split of target_images read (DataComp: ImageNet's train).")
    target_clusters: int | None = Field(None, ge=1, description="The target filter's k-means clusters (null: one "
                                        "per 1,000 samples; DataComp: 100,000 for 12.8M).")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="The seed of the k-means fits and their samples: the same "
                      "pool, settings and seed give the same kept set (0 to 2**32 - 1, scikit-learn's range).")
    report_images: int = Field(24, ge=2, le=400, description="Images on each of the curation report's sheets: the "
                               "samples at the cut (half the lowest-scored kept, half the highest-scored removed) "
                               "and, for each filter, a seeded sample of what it removed with its evidence.")

    @field_validator("languages")
    @classmethod
    def _language_codes(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        bad = [code for code in value if not re.fullmatch(r"[a-z]{2,3}", code)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a language code as lid.176 labels them (two or three lower-case "
                             "letters: en, de, zh, ...)")
        return sorted(set(value))

    @model_validator(mode="after")
    def _confidence_needs_languages(self) -> CurationConfig:
        if self.min_language_confidence is not None and self.languages is None:
            raise ValueError("curation.min_language_confidence is set without curation.languages: it is the "
                             "confidence another language's identification needs to remove a caption; set both")
        return self
