"""A training step's failure that another try would repeat, kept in the run's folder so that the step's retries
end at once instead of spending GPU hours on it again.

KFP retries a step on any failure and cannot tell one exit status from another (its ``set_retry`` has no
policy), so a diverged run or a configuration error was tried up to 4 times, and on several nodes 4 x (1 +
``job_backoff_limit``) times. A retry is for what a retry can change: an eviction, a node lost, a kill. The
step records a permanent failure (:func:`permanent`) in the run's folder; its next try reads the record first
and fails in one line, without starting any pod. A new run (a new run id, a new folder) starts clean.
"""

from __future__ import annotations

import json
import logging
import time

from cloob_core import storage
from cloob_core.config import ConfigError
from cloob_core.errors import StageError, one_line
from cloob_core.ops.trainjob import JobFailed
from cloob_core.redact import redacted

log = logging.getLogger(__name__)

FAILURE_FILE = "failed.json"


class FailedBefore(StageError):
    """An earlier try of this run's training step failed in a way no retry changes."""


def permanent(err: BaseException) -> bool:
    """Whether ``err`` would recur on another try of the same run: the configuration, a diverged or collapsed run
    (``train.on_collapse: stop``), or a process that exited with a code of 1-127 (the code's own failure, not a
    kill by a signal)."""
    from cloob_core.training.collapse import TrainingCollapsed
    from cloob_core.training.loop import TrainingDiverged

    if isinstance(err, (ConfigError, TrainingDiverged, TrainingCollapsed)):
        return True
    code = getattr(err, "exit_code_of_processes", None)  # kubeflow.TrainingFailed: torchrun's exit status
    if isinstance(code, int):
        return 0 < code < 128
    return isinstance(err, JobFailed) and err.permanent


def refuse_if_failed(folder: str) -> None:
    """Raise :class:`FailedBefore` when an earlier try of this run recorded a permanent failure in ``folder``."""
    record = storage.read_json_or(storage.join(folder, FAILURE_FILE), None)
    if isinstance(record, dict):
        raise FailedBefore(f"an earlier try of this run's training failed in a way a retry cannot change, so it is "
                           f"not tried again: {record.get('error', '?')} ({storage.join(folder, FAILURE_FILE)}, "
                           f"{record.get('at', '?')}); fix the cause and start a new run")


def record(folder: str, err: BaseException) -> None:
    """Keep ``err`` as this run's permanent failure (best effort: the step fails with ``err`` either way)."""
    text = json.dumps({"error": redacted(one_line(err)), "type": type(err).__name__,
                       "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    try:
        storage.write_bytes(storage.join(folder, FAILURE_FILE), text.encode())
    except OSError as write_err:
        log.warning("could not record the failure in %s (a retry will try again): %s", folder, one_line(write_err))
