"""The ``cloob eval TASK`` stage: a task's settings and a model in, its results written and returned.

Each task (``tasks/``) is a small frozen dataclass whose fields are the task's options (the CLI builds it from its
flags of the same names, a Kubeflow step from defaults); :func:`evaluate` loads the model and runs the task on the
image sets it names, so the CLI and the Kubeflow step share everything but the printing.
"""

from __future__ import annotations

from pathlib import Path

from cloob_core import lease, publish, storage
from cloob_core.evaluation.tasks.common import EvalOptions, EvalResult
from cloob_core.evaluation.tasks.diagnostics import DiagnosticsTask
from cloob_core.evaluation.tasks.linear_probe import LinearProbeTask
from cloob_core.evaluation.tasks.retrieval import RetrievalTask
from cloob_core.evaluation.tasks.zeroshot import ZeroShotTask
from cloob_core.model.source import ModelSource, load_model

FEATURE_CACHE = ".cache"  # a task's default feature cache inside its output folder (not part of its results)


EvalTask = ZeroShotTask | LinearProbeTask | RetrievalTask | DiagnosticsTask
TASKS: dict[str, type[EvalTask]] = {task.name: task for task in (ZeroShotTask, LinearProbeTask, RetrievalTask,
                                                                  DiagnosticsTask)}


@lease.holding("output")
def evaluate(task: EvalTask, source: ModelSource, output: str | Path,
             options: EvalOptions | None = None) -> EvalResult:
    """Load the model, run ``task``, write its results (CLIP_benchmark JSON, metrics.json, plots, report.md)."""
    storage.ensure_folder(output)
    model = load_model(source)
    with publish.staged(output, keep=True, outside=(FEATURE_CACHE,)) as staging:  # added to the folder's results
        result = task.run(model, options or EvalOptions(), staging)
    result.output = Path(output)
    return result

