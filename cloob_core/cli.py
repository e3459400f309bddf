"""The ``cloob`` command: one subcommand per stage, each a thin caller of a plain function in cloob_core.

DVC stages and KFP components call these same subcommands, so no logic lives outside the library.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import types
import typing
from collections.abc import Sequence

from pydantic import BaseModel

from cloob_core import __version__
from cloob_core.config import CloobConfig, ConfigError, dump_defaults, load_config


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        metavar="PATH",
        help="YAML file with config sections (e.g. params.yaml); defaults are used where it is silent",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        help="override one value, e.g. --set train.objective=clip (repeatable)",
    )


def _add_section_flags(parser: argparse.ArgumentParser, section: str, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per field of a config section, documented from the field itself.

    A flag overrides the value from ``--params``/``--set``; unset flags leave the configuration alone, so the
    typed config stays the single source of defaults.
    """
    model: type[BaseModel] = CloobConfig.model_fields[section].annotation
    group = parser.add_argument_group(f"{section} settings (config section '{section}')")
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        args = typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = next(a for a in args if a is not type(None))
            args = typing.get_args(annotation)
        help_text = f"{field.description} (default: {field.get_default(call_default_factory=True)})"
        options: dict = {"dest": f"cfg__{section}__{name}", "default": None, "help": help_text}
        if annotation is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is typing.Literal:
            options["choices"] = list(args)
        elif typing.get_origin(annotation) is dict:
            options["type"], options["metavar"] = json.loads, "JSON"
        else:
            options["type"] = annotation
            options["metavar"] = name.upper()
        group.add_argument(flag, **options)


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    overrides = []
    for dest, value in vars(args).items():
        if dest.startswith("cfg__") and value is not None:
            _, section, name = dest.split("__", 2)
            overrides.append(f"{section}.{name}={json.dumps(value)}")
    return overrides


def _config_of(args: argparse.Namespace) -> CloobConfig:
    return load_config(args.params, [*args.overrides, *_flag_overrides(args)])


def _cmd_demo(args: argparse.Namespace) -> int:
    from cloob_core.demo import run_demo

    config = load_config(args.params, args.overrides)
    result = run_demo(config, args.output, progress=not args.no_progress)
    zero_shot = result.metrics["zero_shot"]
    print(
        f"zero-shot top-1 on the held-out split ({result.metrics['held_out_images']} images): "
        f"{100 * zero_shot['top1']:.1f}%  (chance {100 * zero_shot['chance']:.1f}%, "
        f"untrained {100 * result.metrics['zero_shot_untrained_top1']:.1f}%, "
        f"mean per-class recall {100 * zero_shot['mean_per_class_recall']:.1f}%)"
    )
    print(
        f"objective {result.metrics['objective']}, {result.metrics['steps']} steps in "
        f"{result.metrics['train_seconds']:.0f} s, final loss {result.metrics['final_loss']:.4f}"
    )
    print(f"wrote {result.output_dir}/metrics.json, loss_history.csv and training_summary.png")
    return 0


def _cmd_data_download(args: argparse.Namespace) -> int:
    from cloob_core.data.download import DownloadInterrupted, download
    from cloob_core.data.manifest import Partition
    from cloob_core.data.summary import format_summary

    config = _config_of(args)
    partition = Partition.parse(args.partition)
    try:
        result = download(args.manifest, args.output, config, partition, args.retry_failed, not args.no_progress)
    except DownloadInterrupted as err:
        print(f"cloob: {err}", file=sys.stderr)
        return 130
    print(format_summary(result.summary))
    if result.summary is not None:
        from cloob_core.pushgateway import push_download_summary

        push_download_summary(config.download.pushgateway, result.summary.stats, args.partition.replace("/", "-"))
    print(f"{result.shards_done} shard(s) built, {result.shards_skipped} already complete, "
          f"{result.seconds:.1f} s; output in {result.output}")
    if partition.count > 1:
        print(f"partition {partition.index}/{partition.count} done; when all are, run: "
              f"cloob data merge-stats --output {result.output}")
    return 0


def _cmd_data_merge_stats(args: argparse.Namespace) -> int:
    from cloob_core.data.summary import format_summary, merge_stats

    summary = merge_stats(args.output)
    print(format_summary(summary))
    print(f"wrote sizes.json, stats.json and failures.jsonl in {args.output}")
    return 0


def _cmd_data_validate(args: argparse.Namespace) -> int:
    from cloob_core.data.validate import run_gate

    if not args.manifest and not args.shards:
        raise ConfigError("cloob data validate needs --manifest, --shards or both")
    report = run_gate(_config_of(args), manifest=args.manifest, shards=args.shards, report_dir=args.report)
    print(report.text())
    return 0 if report.passed else 1


def _cmd_data_shards(args: argparse.Namespace) -> int:
    from cloob_core.data.local_shards import build_shards
    from cloob_core.data.summary import format_summary

    summary = build_shards(args.source, args.output, _config_of(args), manifest=args.manifest, split=args.split,
                           progress=not args.no_progress)
    print(format_summary(summary))
    print(f"output in {args.output}")
    return 0


def _cmd_data_acquire(args: argparse.Namespace) -> int:
    from cloob_core.data.acquire import acquire

    result = acquire(_config_of(args), args.output)
    print(f"acquired {result.rows} rows from {result.source}: {result.manifest}")
    return 0


def _add_data_commands(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="data stages: acquire, download, validate, shards, merge-stats",
                          description="Data stages: manifest -> shards, the validation gate, local folders -> shards.")
    data_sub = data.add_subparsers(dest="data_command", metavar="STAGE", required=True)

    acquire = data_sub.add_parser(
        "acquire",
        help="fix the run's image-text pairs as OUTPUT/manifest.parquet (embedded default or a manifest)",
        description="The pipeline's first stage: write the manifest the gate and the shard build read. "
        "acquire.source 'embedded' lists the packaged digit pairs (rows embedded:SPLIT/INDEX, fetched from the "
        "package by `cloob data download`); otherwise it is a manifest file, local or s3://, kept with all its "
        "columns.",
    )
    acquire.add_argument("--output", required=True, metavar="DIR", help="output folder, local path or s3:// URL")
    _add_config_options(acquire)
    _add_section_flags(acquire, "acquire")
    acquire.set_defaults(func=_cmd_data_acquire)

    dl = data_sub.add_parser(
        "download",
        help="download a manifest of image URLs and captions into WebDataset shards (resumable)",
        description="Fetch, check, resize and shard the images of a manifest (CSV, TSV, parquet or JSONL; local "
        "or s3://; http(s) URLs, or embedded:SPLIT/INDEX rows from `cloob data acquire`). Re-running the same "
        "command resumes: complete shards are skipped. Writes per shard "
        "NNNNN.tar, NNNNN_stats.json and NNNNN_failures.jsonl; for the output sizes.json, stats.json and "
        "failures.jsonl. Exit status 130 after an interrupt (the output stays resumable).",
    )
    dl.add_argument("--manifest", required=True, metavar="PATH", help="manifest file, local path or s3:// URL")
    dl.add_argument("--output", required=True, metavar="DIR", help="output folder, local path or s3:// URL")
    dl.add_argument("--partition", default="0/1", metavar="I/N",
                    help="process only part I of N disjoint parts (shard k belongs to part k %% N); default 0/1")
    dl.add_argument("--retry-failed", action="store_true",
                    help="re-attempt only the rows recorded in failures (except duplicates), into new "
                    "NNNNN-retryRR shards")
    dl.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_config_options(dl)
    _add_section_flags(dl, "download")
    _add_section_flags(dl, "preprocess")
    dl.set_defaults(func=_cmd_data_download)

    merge = data_sub.add_parser(
        "merge-stats",
        help="rebuild sizes.json, stats.json and failures.jsonl from the per-shard records (after partitions)",
        description="Combine the per-shard records in an output folder (e.g. written by several --partition "
        "runs) into sizes.json (open_clip's format), stats.json and failures.jsonl.",
    )
    merge.add_argument("--output", required=True, metavar="DIR", help="the download output folder")
    merge.set_defaults(func=_cmd_data_merge_stats)

    gate = data_sub.add_parser(
        "validate",
        help="the data gate: Great Expectations suites on the manifest and/or the built shards",
        description="Run the manifest suite (--manifest) and/or the shard suite (--shards) with thresholds from "
        "the 'validation' config section. Exit status 1 when an expectation fails; the report names it.",
    )
    gate.add_argument("--manifest", metavar="PATH", help="manifest to check before downloading")
    gate.add_argument("--shards", metavar="DIR", help="download/shards output folder to check")
    gate.add_argument("--report", metavar="DIR", help="write gx_results.json and summary.md here")
    _add_config_options(gate)
    _add_section_flags(gate, "validation")
    _add_section_flags(gate, "download", skip=tuple(
        n for n in CloobConfig.model_fields["download"].annotation.model_fields if n not in (
            "url_col", "caption_col", "input_format")))
    gate.set_defaults(func=_cmd_data_validate)

    shards = data_sub.add_parser(
        "shards",
        help="build shards from the embedded data set or a local folder of images with captions",
        description="Write the download stage's shard layout from local images: --source embedded (the "
        "packaged MNIST pairs), a folder with IMAGE + IMAGE-stem.txt caption sidecars, or --manifest with "
        "file paths (relative to --source) in the URL column.",
    )
    shards.add_argument("--source", required=True, metavar="embedded|DIR", help="'embedded' or an image folder")
    shards.add_argument("--output", required=True, metavar="DIR", help="output folder, local path or s3:// URL")
    shards.add_argument("--manifest", metavar="PATH", help="CSV/TSV/parquet/JSONL of file paths and captions")
    shards.add_argument("--split", choices=["train", "test", "all"], default="train",
                        help="embedded data set split (default: train)")
    shards.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_config_options(shards)
    _add_section_flags(shards, "preprocess")
    shards.set_defaults(func=_cmd_data_shards)


def _cmd_train(args: argparse.Namespace) -> int:
    from cloob_core.training.loop import train

    config = load_config(args.params, [*args.overrides, *_flag_overrides(args)], preset=args.preset)
    result = train(config, args.output, resume=args.resume, progress=not args.no_progress)
    if not result.is_main:
        return 0
    metrics = result.metrics
    print(f"objective {metrics['objective']}, {metrics['steps']} steps of {metrics['batch_size']} pairs "
          f"({metrics['world_size']} rank(s)), final loss {metrics['final_loss']:.4f}, "
          f"{metrics['samples_per_second']:.1f} samples/s")
    print(f"wrote {args.output}/model (open_clip state dict + config), metrics.json, loss_history.csv, "
          "training_curves.png, checkpoints/")
    if args.publish:
        from cloob_core import storage

        copied = storage.upload_tree(args.output, args.publish, exclude=("checkpoints",))
        print(f"published {len(copied)} files (all but checkpoints/) to {args.publish}")
    return 0


def _eval_inputs(args: argparse.Namespace, source: str, split: str):
    from cloob_core.evaluation.inputs import load_images

    return load_images(source, split=split, label_key=args.label_key, class_file=args.classnames)


def _cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cloob_core.evaluation import stages
    from cloob_core.evaluation.inputs import load_model

    model = load_model(args.model, args.architecture, args.weights, args.device)
    output = Path(args.output)
    cache = None if args.no_cache else Path(args.cache or output / ".cache")
    progress = not args.no_progress
    if args.eval_command == "zeroshot":
        test_sets = [_eval_inputs(args, data, args.split) for data in args.data]
        for images in test_sets:
            metrics = stages.zeroshot(model, images, output, cache, args.hopfield_beta, progress)
            top_k = next((key for key in metrics if key.startswith("top") and key != "top1"), "top1")
            print(f"{images.name} zero-shot ({metrics['embeddings']} embeddings): top-1 {100 * metrics['top1']:.2f}%, "
                  f"top-{top_k[3:]} {100 * metrics[top_k]:.2f}%, mean per-class recall "
                  f"{100 * metrics['mean_per_class_recall']:.2f}% (chance {100 * metrics['chance']:.1f}%)")
        if len(test_sets) > 1:
            mean = stages.mean_over_test_sets(model, test_sets, output, args.name or "mean")
            print(f"{args.name or 'mean'} over {len(test_sets)} test sets: top-1 {100 * mean['top1']:.2f}%")
    elif args.eval_command == "linear-probe":
        train = _eval_inputs(args, args.train_data, args.train_split)
        test = _eval_inputs(args, args.test_data or args.train_data, args.test_split)
        validation = _eval_inputs(args, args.val_data, args.val_split) if args.val_data else None
        metrics = stages.linear_probe_stage(model, train, test, output, cache, validation, args.few_shot, args.seed,
                                            progress)
        print(f"{test.name} linear probe: top-1 {100 * metrics['top1']:.2f}% with lambda {metrics['lambda_']:.3g} "
              f"(validation {100 * metrics['validation_accuracy']:.2f}%, {metrics['train_size']} training images)")
    elif args.eval_command == "retrieval":
        images = _eval_inputs(args, args.data, args.split)
        metrics = stages.retrieval(model, images, output, cache, progress)
        print(f"{images.name} retrieval ({metrics['images']} images, {metrics['captions']} captions): "
              + ", ".join(f"{k} {100 * v:.1f}%" for k, v in metrics.items() if "R@" in k))
    else:
        images = _eval_inputs(args, args.data, args.split)
        metrics = stages.diagnostics(model, images, output, cache, progress=progress)
        print(f"{images.name} diagnostics: effective eigenvalues image {metrics['effective_eigenvalues_image']}, "
              f"text {metrics['effective_eigenvalues_text']}; Ajne A_n image {metrics['ajne_image']:.3f}, text "
              f"{metrics['ajne_text']:.3f}; p1 {metrics['positive_probability_p1']:.3f}")
    print(f"wrote results, plots and report.md to {output}")
    return 0


def _add_eval_commands(sub: argparse._SubParsersAction) -> None:
    evaluate = sub.add_parser("eval", help="evaluate a model: zeroshot, linear-probe, retrieval, diagnostics",
                              description="Evaluate a `cloob train` export (or an open_clip architecture with a "
                              "weights file). Results go to OUTPUT as CLIP_benchmark-style JSON per data set and "
                              "task, metrics.json (for DVC), PNG plots and report.md.")
    eval_sub = evaluate.add_subparsers(dest="eval_command", metavar="TASK", required=True)
    data_help = ("'embedded' (the held-out digits), an ImageFolder tree (SPLIT/ inside it is used if present), "
                 "WebDataset shards (folder with sizes.json, .tar, s3://) or a .csv of image,caption rows")

    def common(task: argparse.ArgumentParser) -> None:
        task.add_argument("--model", metavar="DIR", help="`cloob train` model folder (OUTPUT/model), local or s3://")
        task.add_argument("--architecture", help="open_clip config name (with --weights instead of --model)")
        task.add_argument("--weights", metavar="FILE", help="state-dict file for --architecture")
        task.add_argument("--output", default="runs/eval", help="results folder (default: runs/eval)")
        task.add_argument("--cache", metavar="DIR", help="feature cache (default: OUTPUT/.cache)")
        task.add_argument("--no-cache", action="store_true", help="do not cache features")
        task.add_argument("--classnames", metavar="JSON|NAME",
                          help='a JSON file {"classnames": [...], "templates": ["a photo of a {c}.", ...]}, or a '
                          "packaged set of the paper's data sets (cifar10, imagenet, pets, ...)")
        task.add_argument("--label-key", default="label", help="class field in shard json (default: label)")
        task.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
        task.add_argument("--no-progress", action="store_true", help="no progress bars")
        task.set_defaults(func=_cmd_eval)

    zs = eval_sub.add_parser("zeroshot", help="prompt-ensemble zero-shot classification",
                             description="Zero-shot classification with a prompt ensemble: top-1, top-5, mean "
                             "per-class recall, per-class accuracy, confusion matrix.")
    zs.add_argument("--data", nargs="+", default=["embedded"],
                    help=data_help + "; several give each set's metrics and their mean, as for ImageNet-V2's "
                    "three test sets (default: embedded)")
    zs.add_argument("--name", help="data set name for the mean over several --data test sets")
    zs.add_argument("--split", default="test", help="split (default: test)")
    zs.add_argument("--hopfield-beta", type=float, metavar="BETA",
                    help="score Hopfield-retrieved embeddings (memory: the evaluated images) instead of raw ones")
    common(zs)

    lp = eval_sub.add_parser("linear-probe", help="L-BFGS logistic regression with CLIP's lambda search",
                             description="Linear probe on cached image features: lambda by CLIP's parametric "
                             "binary search on the validation split (or a random half of train), refit on "
                             "train(+val), scored on test.")
    lp.add_argument("--train-data", default="embedded", help=data_help + " (default: embedded)")
    lp.add_argument("--train-split", default="train")
    lp.add_argument("--test-data", help="test images (default: --train-data)")
    lp.add_argument("--test-split", default="test")
    lp.add_argument("--val-data", help="validation images (default: a random half of train)")
    lp.add_argument("--val-split", default="val")
    lp.add_argument("--few-shot", type=int, metavar="K", help="train on K images per class")
    lp.add_argument("--seed", type=int, default=0)
    common(lp)

    for name, summary, description in (
        ("retrieval", "image<->text retrieval R@1/5/10, mean and median rank",
         "Image-to-text and text-to-image retrieval; several captions per image count as several correct answers."),
        ("diagnostics", "the paper's embedding analyses (eigenvalues, uniformity, ...)",
         "Effective eigenvalues and spectra, Ajne uniformity, alignment, matched vs top-10 unmatched similarities, "
         "InfoNCE saturation p1."),
    ):
        task = eval_sub.add_parser(name, help=summary, description=description)
        task.add_argument("--data", default="embedded", help=data_help + " (default: embedded)")
        task.add_argument("--split", default="test")
        common(task)

    report = eval_sub.add_parser("report", help="one report over several evaluation folders, with a summary",
                                 description="Combine the results of evaluation folders (e.g. one per task, as the "
                                 "DVC pipeline writes them) into OUTPUT/metrics.json, OUTPUT/report.md with the "
                                 "plots beside it, and print the summary table.")
    report.add_argument("--inputs", nargs="+", required=True, metavar="DIR", help="evaluation output folders")
    report.add_argument("--output", required=True, metavar="DIR", help="report folder")
    report.set_defaults(func=_cmd_eval_report)

    summary = eval_sub.add_parser("summary", help="print the summary table of a report's metrics.json",
                                  description="Print the headline numbers of a `cloob eval report` folder.")
    summary.add_argument("--metrics", default="reports/metrics.json", help="default: reports/metrics.json")
    summary.set_defaults(func=_cmd_eval_summary)

    compare = eval_sub.add_parser(
        "compare", help="several runs' results side by side (e.g. the objectives as DVC experiments)",
        description="One table (Markdown) and one bar chart of zero-shot, linear-probe and retrieval results of "
        "several runs: report metrics.json files by label, or the experiments of `dvc exp show --json`.")
    compare.add_argument("--run", action="append", default=[], metavar="LABEL=METRICS_JSON",
                         help="a report's metrics.json (repeatable)")
    compare.add_argument("--dvc-exps", metavar="FILE", help="output of `dvc exp show --json`: each experiment "
                         "labelled by its name and train.objective")
    compare.add_argument("--metrics-file", default="reports/metrics.json",
                         help="the metrics file of the experiments (default: reports/metrics.json)")
    compare.add_argument("--output", help="folder for comparison.md and comparison.png")
    compare.set_defaults(func=_cmd_eval_compare)


def _cmd_eval_compare(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from cloob_core.evaluation.reports import comparison_markdown, comparison_png
    from cloob_core.io import write_text

    runs: dict[str, dict] = {}
    for spec in args.run:
        label, _, path = spec.partition("=")
        if not path or not Path(path).is_file():
            raise ConfigError(f"--run {spec!r}: expected LABEL=PATH to a report's metrics.json")
        runs[label] = json.loads(Path(path).read_text())
    if args.dvc_exps:
        from cloob_core.evaluation.experiments import runs_from_dvc_exp_show

        runs.update(runs_from_dvc_exp_show(json.loads(Path(args.dvc_exps).read_text()), args.metrics_file))
    if not runs:
        raise ConfigError("nothing to compare: give --run LABEL=metrics.json or --dvc-exps exps.json")
    table = comparison_markdown(runs)
    print(table, end="")
    if args.output:
        output = Path(args.output)
        write_text(output / "comparison.md", table)
        plot = comparison_png(output / "comparison.png", runs)
        print(f"wrote {output}/comparison.md and {output}/{plot}")
    return 0


def _cmd_eval_summary(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from cloob_core.evaluation.reports import summary_table

    path = Path(args.metrics)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; run the pipeline (dvc repro) or `cloob eval report` first")
    print(summary_table(json.loads(path.read_text())))
    return 0


def _cmd_eval_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cloob_core.evaluation.reports import combine_reports, summary_table

    combined = combine_reports([Path(p) for p in args.inputs], Path(args.output))
    print(summary_table(combined))
    print(f"wrote {args.output}/metrics.json and {args.output}/report.md")
    return 0


def _cmd_promote(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict
    from pathlib import Path

    from cloob_core import promotion
    from cloob_core.io import write_json

    config = _config_of(args)
    metrics = json.loads(Path(args.metrics).read_text())
    if args.record_production_metrics:
        pointer = promotion.record_production_metrics(config.promote.store, metrics)
        print(f"recorded {len(pointer['metrics'])} metrics for production model {pointer['model_id']} in "
              f"{config.promote.store}")
        return 0
    if not args.model:
        raise ConfigError("cloob promote needs --model (or --record-production-metrics)")
    decision = promotion.promote(args.model, metrics, config.promote)
    if args.output:
        write_json(args.output, asdict(decision))
    print(decision.summary())
    return 0


def _add_promote_command(sub: argparse._SubParsersAction) -> None:
    promote = sub.add_parser(
        "promote", help="the promotion gate: make a model production if it beats the current one",
        description="Compare a model's evaluation metrics with production's; promote (copy it into the store and "
        "move the production.json pointer atomically) when promote.metric improves by promote.min_improvement and "
        "no guarded metric regresses beyond its tolerance. Every decision is kept in STORE/history/. Not "
        "promoting is a normal outcome (exit status 0).")
    promote.add_argument("--model", metavar="DIR", help="the candidate: a `cloob train` model folder")
    promote.add_argument("--metrics", default="reports/metrics.json",
                         help="its `cloob eval report` metrics.json (default: reports/metrics.json)")
    promote.add_argument("--output", metavar="FILE", help="write the decision as JSON here (e.g. for DVC metrics)")
    promote.add_argument("--record-production-metrics", action="store_true",
                         help="instead: store --metrics as production's current metrics (after re-evaluating it)")
    _add_config_options(promote)
    _add_section_flags(promote, "promote")
    promote.set_defaults(func=_cmd_promote)


def _cmd_config(args: argparse.Namespace) -> int:
    if args.params or args.overrides:
        import yaml

        print(yaml.safe_dump(load_config(args.params, args.overrides).model_dump(), sort_keys=False), end="")
    else:
        print(dump_defaults(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cloob",
        description="CLOOB contrastive image-text pretraining: every pipeline stage as a subcommand.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="train a tiny CLOOB model on the embedded digits (CPU) and report held-out zero-shot accuracy",
        description="Train the tiny CLOOB model on the embedded MNIST image-caption pairs and report "
        "zero-shot top-1 accuracy on the held-out split next to chance. Writes metrics.json, "
        "loss_history.csv and training_summary.png.",
    )
    _add_config_options(demo)
    demo.add_argument("--output", default="runs/demo", help="output folder (default: runs/demo)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=_cmd_demo)

    config = sub.add_parser(
        "config",
        help="print the configuration (defaults, or a params file with overrides applied)",
        description="Print the typed configuration as YAML. Without options: the defaults, which is what "
        "params.yaml holds. With --params/--set: the validated result.",
    )
    _add_config_options(config)
    config.set_defaults(func=_cmd_config)
    _add_data_commands(sub)

    train = sub.add_parser(
        "train",
        help="pretrain with CLOOB (or another objective) on WebDataset shards; single process, torchrun or SLURM",
        description="Train the dual encoder on shards from `cloob data`. Launch with torchrun (or under the "
        "Kubeflow Training Operator or SLURM) for several GPUs or nodes; a plain call is one process on the CPU "
        "or one GPU. Writes OUTPUT/model (open_clip state dict, config, tokenizer name), checkpoints/, "
        "metrics.json, loss_history.csv, training_curves.png and tensorboard/.",
    )
    train.add_argument("--output", default="runs/train", help="output folder (default: runs/train)")
    train.add_argument("--resume", metavar="latest|PATH",
                       help="continue from a checkpoint: 'latest' (OUTPUT/checkpoints, then train.checkpoint_sync) "
                       "or a path / s3:// URL")
    train.add_argument("--preset", choices=["cc3m", "yfcc"],
                       help="the paper's recipe for CC3M (batch 512, lr 1e-3, warmup 20k, beta 8) or YFCC (1024, "
                       "5e-4, 10k, 14.3), RN50; applied over --params, under --set")
    train.add_argument("--publish", metavar="URL",
                       help="after training, rank 0 copies OUTPUT (all but checkpoints/) to this local folder or "
                       "s3:// prefix: how pods of a multi-node job hand their result back")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_config_options(train)
    _add_section_flags(train, "train")
    train.set_defaults(func=_cmd_train)
    _add_eval_commands(sub)
    _add_promote_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("great_expectations", "botocore", "boto3", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as err:  # ManifestError is a ValueError
        print(f"cloob: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if type(err).__module__.startswith(("botocore", "boto3")):  # no bucket, no credentials, access denied
            print(f"cloob: S3: {err}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
