"""The evaluation suite's section (``eval``) and its vocabulary: tasks, results, packaged sources."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from cloob_core.config.base import _Section

# The evaluation suite's vocabulary. `cloob eval TASK` -> the result it writes, named as CLIP_benchmark names its
# tasks: results are <data set>_<result> (mnist_zeroshot_classification), metrics <data set>_<result>.<key>.
TASK_RESULTS: dict[str, str] = {"zeroshot": "zeroshot_classification", "linear-probe": "linear_probe",
                                "retrieval": "zeroshot_retrieval", "diagnostics": "diagnostics"}
TaskName = Literal["zeroshot", "linear-probe", "retrieval", "diagnostics"]  # the keys of TASK_RESULTS
# Data sets that ship inside this package (cloob_core/data/packaged.py); they need no path.
PACKAGED_SETS = ("captioned", "tuxpaint", "fluent-emoji", "mnist")
# Evaluation sources read from installed packages: ours and scikit-learn's 8x8 digits.
PACKAGED_SOURCES = (*PACKAGED_SETS, "sklearn-digits")
SUITE_RESULT = "suite"  # the result holding the aggregates: suite.<aggregate> beside <data set>_<result>.<key>
# Data-set and aggregate names become folder names, DVC stage names (eval@NAME) and the first part of metric
# names, so they may not hold a dot (the separator of RESULT.KEY), a slash or spaces.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_@+-]*")


def result_name(dataset: str, task: str) -> str:
    return f"{dataset}_{TASK_RESULTS[task]}"



class SplitsConfig(_Section):
    """Which split of a data set each role reads (subfolders of an ImageFolder tree, of a wds set)."""

    test: str = Field("test", description="The split every task scores.")
    train: str = Field("train", description="The linear probe's training split.")
    val: str | None = Field(None, description="The linear probe's validation split for the lambda search "
                            "(null: a random half of train, CLIP's recipe).")


class DatasetConfig(_Section):
    """One data set of the evaluation suite; its name is its key in ``eval.datasets``."""

    source: str = Field(description="A packaged set (captioned, tuxpaint, fluent-emoji, mnist), "
                        "'sklearn-digits' (scikit-learn's 8x8 digits), an ImageFolder tree, CLIP_benchmark wds "
                        "shards (`cloob data eval-set`), `cloob data` shards or an image,caption .csv; a local "
                        "path or s3://.")
    tasks: list[TaskName] = Field(["zeroshot"], min_length=1, description="zeroshot, linear-probe, "
                                  "retrieval, diagnostics.")
    splits: SplitsConfig = Field(default_factory=SplitsConfig)
    classnames: str | None = Field(None, description="Class names and templates: a packaged set (imagenet, "
                                   "cifar10, ...) or a JSON file (null: from the source).")
    label_key: str = Field("label", description="The class field in the json of `cloob data` shards.")
    few_shot: int | None = Field(None, ge=1, description="Linear probe on K training images per class "
                                 "(null: all).")
    batch_size: int = Field(256, ge=1, description="Images per encoding batch.")

    @field_validator("tasks")
    @classmethod
    def _once_each(cls, tasks: list[str]) -> list[str]:
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"a task is named twice in {tasks}")
        return tasks


class AggregateConfig(_Section):
    """A suite-level figure: the mean of per-data-set metrics, written as ``suite.<name>``."""

    of: list[str] = Field(min_length=1, description="RESULT.KEY of each data set's metrics, e.g. "
                          "zeroshot_classification.acc1; several are averaged together.")
    datasets: list[str] | None = Field(None, description="The data sets averaged over (null: every data set "
                                       "that writes the result).")

    @field_validator("of", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


def _default_datasets() -> dict[str, DatasetConfig]:
    # Retrieval and diagnostics on the held-out captions of the training distribution; zero-shot and linear
    # probes on its two sources' categories, and on MNIST digits, which the captioned set never shows.
    return {"captioned": DatasetConfig(source="captioned", tasks=["retrieval", "diagnostics"]),
            "tuxpaint": DatasetConfig(source="tuxpaint", tasks=["zeroshot", "linear-probe"]),
            "emoji": DatasetConfig(source="fluent-emoji", tasks=["zeroshot", "linear-probe"]),
            "mnist": DatasetConfig(source="mnist", tasks=["zeroshot", "linear-probe"])}


def _default_aggregates() -> dict[str, AggregateConfig]:
    return {"zeroshot_acc1": AggregateConfig(of=["zeroshot_classification.acc1"]),
            "linear_probe_acc1": AggregateConfig(of=["linear_probe.lp_acc1"]),
            "retrieval_recall@1": AggregateConfig(of=["zeroshot_retrieval.image_retrieval_recall@1",
                                                      "zeroshot_retrieval.text_retrieval_recall@1"]),
            "retrieval_recall@5": AggregateConfig(of=["zeroshot_retrieval.image_retrieval_recall@5",
                                                      "zeroshot_retrieval.text_retrieval_recall@5"])}


class EvalConfig(_Section):
    """The evaluation suite: what `dvc repro`, the Kubeflow pipelines and the promotion gate evaluate on."""

    datasets: dict[str, DatasetConfig] = Field(default_factory=_default_datasets, min_length=1,
                                               description="Data sets by name (unique: they are mapping keys).")
    aggregates: dict[str, AggregateConfig] = Field(default_factory=_default_aggregates,
                                                   description="Suite means by name, as suite.<name>.")

    @model_validator(mode="after")
    def _names_and_references(self) -> EvalConfig:
        for kind, names in (("data set", self.datasets), ("aggregate", self.aggregates)):
            for name in names:
                if not NAME_PATTERN.fullmatch(name) or name == SUITE_RESULT:
                    raise ValueError(f"{kind} name {name!r} must be letters, digits, _ @ + - (no dots, not "
                                     f"{SUITE_RESULT!r})")
        results = {TASK_RESULTS[task]: task for task in TASK_RESULTS}
        if "aggregates" not in self.model_fields_set:  # the defaults apply where the user's suite has their tasks
            kept = {name: aggregate for name, aggregate in self.aggregates.items()
                    if all(self.contributors(name, metric.partition(".")[0]) for metric in aggregate.of)}
            object.__setattr__(self, "aggregates", kept)
        for name, aggregate in self.aggregates.items():
            for metric in aggregate.of:
                result, _, key = metric.partition(".")
                if result not in results or not key:
                    raise ValueError(f"aggregates.{name}: {metric!r} is not RESULT.KEY with RESULT one of "
                                     f"{sorted(results)}")
                unknown_sets = sorted(set(aggregate.datasets or ()) - set(self.datasets))
                if unknown_sets:
                    raise ValueError(f"aggregates.{name}: no data set named {unknown_sets} in eval.datasets")
                if not self.contributors(name, result):
                    raise ValueError(f"aggregates.{name}: no data set of the suite runs "
                                     f"{results[result]!r}, so {metric!r} has nothing to average")
        return self

    def contributors(self, aggregate: str, result: str) -> list[str]:
        """The data sets whose ``result`` an aggregate averages."""
        chosen = self.aggregates[aggregate].datasets or list(self.datasets)
        return [name for name in chosen if any(TASK_RESULTS[t] == result for t in self.datasets[name].tasks)]

    def metric_names(self) -> set[str]:
        """The RESULT names the suite writes (``<data set>_<result>`` and ``suite``)."""
        return {SUITE_RESULT} | {result_name(name, task) for name, entry in self.datasets.items()
                                 for task in entry.tasks}
