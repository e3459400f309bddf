"""The data path's sections: preprocessing, acquiring, downloading, the engine and the gate."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from cloob_core.config.base import _Section
from cloob_core.redact import SECRET_QUERY_PARAMS


class PreprocessConfig(_Section):
    """How every image and caption is checked, resized and encoded before it enters a shard."""

    image_size: int = Field(256, ge=8, le=8192, description="Target side in pixels (img2dataset's default 256).")
    resize_mode: Literal["keep_ratio", "center_crop", "border", "no"] = Field(
        "keep_ratio",
        description="keep_ratio: shortest side to image_size; center_crop: then a centred square; border: longest "
        "side to image_size, padded to a square; no: keep the original size.",
    )
    resize_only_if_bigger: bool = Field(True, description="Never enlarge: resize only images larger than the target "
                                        "(an enlarged image adds bytes, not detail; training resizes anyway). false: "
                                        "enlarge smaller ones too, as img2dataset does by default.")
    max_side: int | None = Field(1024, ge=8, description="Longest side stored: an image that resizing leaves longer "
                                 "(a panorama under keep_ratio, a large image under no) is scaled down to it, keeping "
                                 "its ratio; null: no bound. At least image_size.")

    @field_validator("resize_mode", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML 1.1 reads an unquoted `no` as false
    jpeg_quality: int = Field(95, ge=1, le=100, description="JPEG quality of the re-encoded image.")
    min_image_side: int = Field(8, ge=0, description="Drop images whose original shorter side is below this (as "
                                "too_small): the gate's validation.min_image_side, so that an image too small to "
                                "enlarge is dropped by name rather than failing the shard gate.")
    max_aspect_ratio: float | None = Field(
        None, ge=1.0, description="Drop images whose original long/short side ratio exceeds this (null: no limit)."
    )
    max_image_pixels: int = Field(
        89_478_485,
        ge=1,
        description="Decompression-bomb guard: refuse images with more pixels than this before decoding "
        "(Pillow's own default limit).",
    )
    min_caption_chars: int = Field(1, ge=0, description="Drop captions shorter than this (1 drops empty captions).")
    max_caption_chars: int | None = Field(2000, ge=1, description="Drop captions longer than this (null: no limit).")
    shard_size: int = Field(256, ge=1, description="Manifest rows per shard. 256 gives the captioned default's "
                            "2,047 training pairs 8 shards, one per data stream; web-scale sets use img2dataset's "
                            "10000.")
    dedup_content: bool = Field(True, description="Keep identical image bytes (sha256) once; later copies are dropped.")

    @model_validator(mode="after")
    def _side_bound_holds_the_target(self) -> PreprocessConfig:
        if self.max_side is not None and self.max_side < self.image_size:
            raise ValueError(f"preprocess.max_side {self.max_side} is below preprocess.image_size {self.image_size}: "
                             "the resized images could never reach the target; raise it or set it to null")
        return self


class DownloadConfig(_Section):
    """How manifests are read and URLs fetched. Per-run choices (paths, partition) are command-line options."""

    url_col: str = Field("url", description="Manifest column holding the image URL.")
    caption_col: str = Field("caption", description="Manifest column holding the caption.")
    input_format: Literal["auto", "csv", "tsv", "parquet", "jsonl"] = Field(
        "auto", description="Manifest format of text files (a .parquet file is parquet); auto: from the file "
        "suffix. Header-less caption<TAB>url is detected."
    )
    processes: int = Field(0, ge=0, description="Worker processes (0: one per CPU core).")
    threads: int = Field(32, ge=1, le=1024, description="Download threads per worker process.")
    connect_timeout: float = Field(5.0, gt=0, description="Seconds to establish a connection.")
    read_timeout: float = Field(10.0, gt=0, description="Seconds a read may wait for the next bytes.")
    url_deadline: float = Field(
        30.0, gt=0, description="Seconds one URL may take in all, retries included (a slow drip cannot hold a worker)."
    )
    retries: int = Field(2, ge=0, description="Extra attempts after transient errors (5xx, timeouts, resets).")
    backoff: float = Field(0.5, ge=0, description="First retry delay in seconds; doubles on each retry.")
    max_redirects: int = Field(5, ge=0, description="Redirects followed per URL.")
    max_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="Largest response body accepted, in bytes.")
    respect_opt_out: bool = Field(
        True, description="Skip images whose X-Robots-Tag says noai, noimageai, noindex or noimageindex."
    )
    allow_private_network: bool = Field(
        False,
        description="Allow URLs resolving to loopback, private or link-local addresses (refused by default; "
        "needed for servers on 127.0.0.1). Cloud-metadata endpoints stay refused.",
    )
    dedup_urls: bool = Field(True, description="Fetch a URL repeated in the manifest once; later rows are dropped.")
    redact_query_params: list[str] = Field(
        default_factory=lambda: list(SECRET_QUERY_PARAMS),
        description="Query parameters whose values are replaced by REDACTED wherever a URL is recorded (failure "
        "files, the samples' json, the gate's report, logs); user info is always removed. The fetch uses the full "
        "URL. Case-insensitive.")
    pushgateway: str | None = Field(None, description="Prometheus Pushgateway address; each download (partition) "
                                    "pushes its rows, successes and failures by reason (null: no push).")


class AcquireConfig(_Section):
    """``cloob data acquire``: where the pipeline's image-text pairs come from."""

    source: str = Field("captioned", description="A packaged set (captioned: 2,551 real image-caption pairs; "
                        "mnist: digits with template captions; all in cloob_core/data/packaged.py), split below, "
                        "or a manifest of image URLs and captions (CSV/TSV/parquet/JSONL, local path or s3://).")
    split: Literal["train", "test", "all"] = Field("train", description="Packaged split to train on; the "
                                                   "evaluation keeps the held-out 'test' split.")


_ENGINE_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(%|[KMGT]i?B|B)", re.IGNORECASE)


class EngineConfig(_Section):
    """The out-of-core engine (DuckDB) of the manifest-wide steps: URL duplicates, the gate's aggregates."""

    memory_limit: str = Field("512MB", description="Most memory the engine holds (DuckDB's memory_limit); beyond it "
                              "it spills to spill_dir. Manifest-wide steps stay within this whatever the rows.")
    threads: int = Field(0, ge=0, description="Engine threads (0: DuckDB's default, one per core it may use).")
    spill_dir: str | None = Field(None, description="Local folder the engine spills to (null: a temporary folder); "
                                  "needs about the size of the manifest's URL column for 10^9 rows.")

    @field_validator("memory_limit")
    @classmethod
    def _size(cls, value: str) -> str:
        """A size DuckDB reads the same way: a positive number with a unit (KB, MiB, GB, ...) or a percentage
        of the machine's memory; DuckDB itself would take ``-5GB`` as its default and ``abc`` only later."""
        found = _ENGINE_SIZE.fullmatch(value.strip())
        if found is None or float(found.group(1)) <= 0 or (found.group(2) == "%" and float(found.group(1)) > 100):
            raise ValueError(f"{value!r} is not a memory size: give a positive number with a unit (512MB, 4GiB, "
                             "1TB) or a percentage of the memory (50%)")
        return value.strip()

    @field_validator("spill_dir")
    @classmethod
    def _local_folder(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or "://" in value):
            raise ValueError(f"{value!r} is not a local folder (the engine spills to a local disk)")
        return value


class ValidationConfig(_Section):
    """Thresholds of the data gate (``cloob data validate``)."""

    min_rows: int = Field(1, ge=0, description="Fewest manifest rows accepted.")
    max_caption_chars: int = Field(2000, ge=1, description="Longest caption accepted in the manifest.")
    max_bad_row_fraction: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Fraction of manifest rows allowed to break a row expectation (a bad or repeated URL, a "
        "caption longer than max_caption_chars).",
    )
    max_empty_caption_fraction: float = Field(
        0.05, ge=0.0, le=1.0, description="Fraction of manifest rows allowed an empty caption: the download drops "
        "them (preprocess.min_caption_chars), so a crawl's few cost nothing; many say the caption column is wrong.")
    min_success_ratio: float = Field(
        0.5, ge=0.0, le=1.0, description="Fewest successes per manifest row attempted, over the whole output."
    )
    min_image_side: int = Field(8, ge=1, description="Smallest stored image side accepted in the shards.")
    min_curated_fraction: float = Field(0.01, ge=0.0, le=1.0, description="Curated shards (`cloob data curate`, "
                                        "with its curation_report.json): fewest kept per sample of the pool; the "
                                        "failing line names the filter that removed the most.")
    max_image_side: int = Field(8192, ge=1, description="Largest stored image side accepted in the shards.")
    manifest_sample: int = Field(10_000, ge=0, description="Manifest rows the row-level expectations check, "
                                 "picked by a hash of the row (plus up to 20 rows breaking each exact check, as "
                                 "examples); the counts come from exact aggregates over every row.")
    decode_sample: int = Field(64, ge=0, description="Samples per shard the gate decodes in full (image, UTF-8 "
                               "caption, JSON metadata), picked by a hash of their keys; 0 checks presence only.")
    max_undecodable_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Fraction of a shard's decoded "
                                            "samples allowed to fail; a shard above it fails the gate, by name.")
    caption_sample: int = Field(10_000, ge=0, description="Captions tokenised with model.architecture's "
                                "tokenizer to measure how they fit its text context: by the manifest gate from its "
                                "sample, by the shard gate from its decoded samples, by training from its shards "
                                "before the first step. 0 measures nothing.")
    warn_truncated_caption_fraction: float = Field(0.1, ge=0.0, le=1.0, description="Share of sampled "
                                                   "captions longer than the model's text context above which "
                                                   "the gate and training warn (their ends do not train).")
    max_truncated_caption_fraction: float = Field(0.5, ge=0.0, le=1.0, description="Share of sampled captions "
                                                  "longer than the model's text context above which the gate "
                                                  "fails and training refuses to start.")
    max_merged_caption_fraction: float = Field(0.05, ge=0.0, le=1.0, description="Share of distinct sampled "
                                               "captions that cutting to the model's context makes identical "
                                               "to another, above which the gate fails and training refuses.")
    max_top_caption_share: float = Field(0.5, ge=0.0, le=1.0, description="Share of sampled captions that are "
                                         "one and the same caption above which the gate fails and training warns: "
                                         "captions that do not differ teach nothing (ten class names give 0.1).")
