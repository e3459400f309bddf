"""``cloob eval``: the single tasks (zeroshot, linear-probe, retrieval, diagnostics), the suite, the production
model's re-evaluation, the training trajectory, and the reports over results; each calls one function of
cloob_core.evaluation (or cloob_core.ops) and prints its lines."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from cloob_core.cli.options import (
    add_command,
    add_config_options,
    add_model_source,
    add_output_and_device,
    config_of,
    model_source_of,
)
from cloob_core.config import TASK_RESULTS

DATA_HELP = ("a packaged set (captioned, tuxpaint, fluent-emoji, mnist, sklearn-digits), an ImageFolder tree (SPLIT/ "
             "inside it is used if present), WebDataset shards (folder with sizes.json, .tar, s3://) or a .csv of "
             "image,caption rows")
TASK_HELP = {
    "retrieval": ("image<->text retrieval R@1/5/10, mean and median rank",
                  "Image-to-text and text-to-image retrieval; several captions per image count as several correct "
                  "answers."),
    "diagnostics": ("the paper's embedding analyses (eigenvalues, uniformity, ...)",
                    "Effective eigenvalues and spectra, Ajne uniformity, alignment, matched vs top-10 unmatched "
                    "similarities, InfoNCE saturation p1."),
}


def _task(args: argparse.Namespace) -> int:
    from cloob_core.evaluation.run import FEATURE_CACHE, TASKS, evaluate
    from cloob_core.evaluation.tasks.common import EvalOptions

    task_class = TASKS[args.eval_command]
    task = task_class(**{f.name: getattr(args, f.name) for f in dataclasses.fields(task_class)})
    output = Path(args.output)
    options = EvalOptions(classnames=args.classnames, label_key=args.label_key, progress=not args.no_progress,
                          csv_columns=(args.url_col, args.caption_col),
                          cache=None if args.no_cache else Path(args.cache or output / FEATURE_CACHE),
                          workers=args.workers, batch_size=args.batch_size)
    source = model_source_of(args)
    result = evaluate(task, source, output, options)
    for line in result.lines:
        print(line)
    print(f"wrote results, plots and report.md to {output}")
    return 0


def _trajectory(args: argparse.Namespace) -> int:
    """Evaluate each checkpoint of a `cloob train` run (RUN/checkpoints/step-*.pt) as the model it was: effective
    eigenvalues and spectra, Ajne uniformity and InfoNCE saturation p1 of the data's matched pairs, into
    OUTPUT/trajectory.json. Keep the checkpoints with train.keep_checkpoints."""
    from cloob_core.evaluation.trajectory import evaluate_trajectory

    result = evaluate_trajectory(args.run, args.data, args.split, args.output, device=args.device,
                                 precision=args.precision, workers=args.workers,
                                 progress=not args.no_progress)
    for line in result.lines:
        print(line)
    print(f"wrote {result.file}")
    return 0


def _suite(args: argparse.Namespace) -> int:
    """Evaluate every data set of the config's eval suite (or those named) on its tasks, into OUTPUT/<data set>/. Each
    entry's source, splits and class list are checked before the model loads; a data set's tasks share its features."""
    from cloob_core.evaluation.suite import evaluate_suite

    model = model_source_of(args)
    results = evaluate_suite(config_of(args).eval, model, args.output, datasets=args.dataset, tasks=args.task,
                             cache=Path(args.cache) if args.cache else None, progress=not args.no_progress,
                             workers=args.workers)
    for result in results:
        for line in result.lines:
            print(line)
    print(f"wrote results, plots and report.md of {len(results)} data set(s) to {args.output}/<data set>")
    return 0


def _production(args: argparse.Namespace) -> int:
    """Fetch the production model of promote.store, evaluate it on the config's eval suite into OUTPUT (model/,
    datasets/, report/) and record its metrics with the suite's fingerprint, so the promotion gate compares the next
    candidate with it on the same suite."""
    from cloob_core.evaluation.tables import summary_table
    from cloob_core.ops.reevaluation import reevaluate_production

    config = config_of(args)
    done = reevaluate_production(config, args.output, device=args.device, precision=args.precision,
                                 workers=args.workers, progress=not args.no_progress)
    print(summary_table(done.report.metrics))
    print(f"recorded production model {done.model_id}'s metrics on suite {done.pointer['suite'][:12]} in "
          f"{config.promote.store}")
    return 0


def _report(args: argparse.Namespace) -> int:
    """Combine the results of evaluation folders into OUTPUT/metrics.json, OUTPUT/report.md with the plots beside it,
    and print the summary table. With --params (or --set), the config's eval suite: only its results, all of them
    required, and its aggregates as the result 'suite'."""
    from cloob_core.evaluation.records import combine_reports
    from cloob_core.evaluation.suite_report import suite_report
    from cloob_core.evaluation.tables import summary_table

    if args.params or args.overrides:
        report = suite_report(config_of(args).eval, args.inputs, args.output, model=args.model)
    else:
        report = combine_reports([Path(p) for p in args.inputs], Path(args.output), model=args.model)
    print(summary_table(report.metrics))
    print(f"wrote {args.output}/metrics.json and {args.output}/report.md")
    return 0


def _summary(args: argparse.Namespace) -> int:
    """Print the headline numbers of a `cloob eval report` folder."""
    from cloob_core.evaluation.records import read_metrics
    from cloob_core.evaluation.tables import summary_table

    print(summary_table(read_metrics(args.metrics)))
    return 0


def _compare(args: argparse.Namespace) -> int:
    """One table (Markdown) and one bar chart of zero-shot, linear-probe and retrieval results of several runs: report
    metrics.json files by label, or the experiments of `dvc exp show --json`."""
    from cloob_core.evaluation.comparison import compare_runs

    comparison = compare_runs(args.run, args.dvc_exps, args.metrics_file, args.output)
    print(comparison.table, end="")
    if comparison.written:
        print("wrote " + " and ".join(str(path) for path in comparison.written))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    evaluate = sub.add_parser("eval", help="evaluate a model: zeroshot, linear-probe, retrieval, diagnostics",
                              description="Evaluate a `cloob train` export (or an open_clip architecture with a "
                              "weights file). Results go to OUTPUT as CLIP_benchmark-style JSON per data set and "
                              "task, metrics.json (for DVC), PNG plots and report.md.")
    evaluate.set_defaults(grain="coarse")  # OpenMP's spin count (cloob_core.threads): the tasks' math is coarse
    tasks = evaluate.add_subparsers(dest="eval_command", metavar="TASK", required=True)
    _add_zeroshot(tasks)
    _add_linear_probe(tasks)
    for name in ("retrieval", "diagnostics"):
        _add_one_set_task(tasks, name)
    _add_trajectory(tasks)
    _add_suite(tasks)
    _add_production(tasks)
    _add_report(tasks)
    _add_summary(tasks)
    _add_compare(tasks)


def _add_task_options(parser: argparse.ArgumentParser) -> None:
    """What every single task takes: the model, the output, the feature cache and the class names."""
    add_model_source(parser)
    add_output_and_device(parser, "runs/eval")
    parser.add_argument("--cache", metavar="DIR", help="feature cache (default: OUTPUT/.cache)")
    parser.add_argument("--no-cache", action="store_true", help="do not cache features")
    parser.add_argument("--batch-size", type=int, default=256, help="images per batch (default: 256)")
    parser.add_argument("--classnames", metavar="JSON|NAME",
                        help='a JSON file {"classnames": [...], "templates": ["a photo of a {c}.", ...]}, or a '
                        "packaged set of the paper's data sets (cifar10, imagenet, pets, ...)")
    parser.add_argument("--label-key", default="label", help="class field in shard json (default: label)")
    parser.add_argument("--url-col", default="image", help="a captions .csv's column of image paths (default: image)")
    parser.add_argument("--caption-col", default="caption", help="a captions .csv's caption column (default: caption)")


def _add_zeroshot(tasks: argparse._SubParsersAction) -> None:
    parser = add_command(tasks, "zeroshot", _task, "prompt-ensemble zero-shot classification",
                         "Zero-shot classification with a prompt ensemble: acc1, acc5, mean per-class recall, "
                         "per-class accuracy, confusion matrix.")
    parser.add_argument("--data", nargs="+", default=["captioned"],
                        help=DATA_HELP + "; several give each set's metrics and their mean, as for ImageNet-V2's "
                        "three test sets (default: captioned)")
    parser.add_argument("--name", dest="mean_name", help="data set name for the mean over several --data test sets")
    parser.add_argument("--split", default="test", help="split (default: test)")
    parser.add_argument("--hopfield-beta", type=float, metavar="BETA",
                        help="score Hopfield-retrieved embeddings (memory: the evaluated images) instead of raw ones")
    _add_task_options(parser)


def _add_linear_probe(tasks: argparse._SubParsersAction) -> None:
    parser = add_command(tasks, "linear-probe", _task, "L-BFGS logistic regression with CLIP's lambda search",
                         "Linear probe on cached image features: lambda by CLIP's parametric binary search on the "
                         "validation split (or a random half of train), refit on train(+val), scored on test.")
    parser.add_argument("--train-data", "--data", dest="train_data", default="captioned",
                        help=DATA_HELP + "; --data as for the other tasks (default: captioned)")
    parser.add_argument("--train-split", default="train")
    parser.add_argument("--test-data", help="test images (default: --train-data)")
    parser.add_argument("--test-split", default="test")
    parser.add_argument("--val-data", help="validation images (default: a random half of train)")
    parser.add_argument("--val-split", default="val")
    parser.add_argument("--few-shot", type=int, metavar="K", help="train on K images per class")
    parser.add_argument("--seed", type=int, default=0)
    _add_task_options(parser)


def _add_one_set_task(tasks: argparse._SubParsersAction, name: str) -> None:
    summary, description = TASK_HELP[name]
    parser = add_command(tasks, name, _task, summary, description)
    parser.add_argument("--data", default="captioned", help=DATA_HELP + " (default: captioned)")
    parser.add_argument("--split", default="test")
    _add_task_options(parser)


def _add_trajectory(tasks: argparse._SubParsersAction) -> None:
    parser = add_command(tasks, "trajectory", _trajectory,
                         "the diagnostics at every checkpoint of a training run (the paper's Fig. 2, A1)")
    parser.add_argument("--run", required=True, metavar="DIR", help="`cloob train` output folder")
    parser.add_argument("--data", default="captioned", help=DATA_HELP + " (default: captioned)")
    parser.add_argument("--split", default="test")
    add_output_and_device(parser, "runs/trajectory")


def _add_suite(tasks: argparse._SubParsersAction) -> None:
    parser = add_command(tasks, "suite", _suite,
                         "the evaluation suite of the config (eval.datasets), each data set on its tasks")
    add_config_options(parser)
    parser.add_argument("--dataset", action="append", metavar="NAME", help="only this data set (repeatable)")
    parser.add_argument("--task", action="append", choices=list(TASK_RESULTS), help="only this task (repeatable)")
    add_model_source(parser)
    add_output_and_device(parser, "runs/eval")
    parser.add_argument("--cache", metavar="DIR", help="feature cache kept between runs (default: none)")


def _add_production(tasks: argparse._SubParsersAction) -> None:
    parser = add_command(tasks, "production", _production,
                         "re-evaluate the production model on the suite and record its metrics")
    add_config_options(parser)
    add_output_and_device(parser, "runs/production")


def _add_report(tasks: argparse._SubParsersAction) -> None:
    parser = add_command(tasks, "report", _report, "one report over several evaluation folders, with a summary")
    add_config_options(parser)
    parser.add_argument("--inputs", nargs="+", required=True, metavar="DIR",
                        help="evaluation output folders (with the suite: also `cloob eval suite`'s OUTPUT)")
    parser.add_argument("--output", required=True, metavar="DIR", help="report folder")
    parser.add_argument("--model", metavar="DIR",
                        help="the evaluated `cloob train` model folder: report.md describes it from its "
                        "model_info.json (objective, steps, starting weights, each training source's share)")


def _add_summary(tasks: argparse._SubParsersAction) -> None:
    parser = add_command(tasks, "summary", _summary, "print the summary table of a report's metrics.json")
    parser.add_argument("--metrics", default="reports/metrics.json", help="default: reports/metrics.json")


def _add_compare(tasks: argparse._SubParsersAction) -> None:
    parser = add_command(tasks, "compare", _compare,
                         "several runs' results side by side (e.g. the objectives as DVC experiments)")
    parser.add_argument("--run", action="append", default=[], metavar="LABEL=METRICS_JSON",
                        help="a report's metrics.json (repeatable)")
    parser.add_argument("--dvc-exps", metavar="FILE", help="output of `dvc exp show --json`: each experiment "
                        "labelled by its name and train.objective")
    parser.add_argument("--metrics-file", default="reports/metrics.json",
                        help="the metrics file of the experiments (default: reports/metrics.json)")
    parser.add_argument("--output", help="folder for comparison.md and comparison.png")
