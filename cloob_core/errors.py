"""The failures a stage reports to its caller: a user can act on each, so each carries a message, not a traceback.

Every stage function raises a subclass of :class:`StageError` when it cannot do its work. The ``cloob`` CLI
prints the message (and the ``details``, e.g. a gate's report) and exits with ``exit_code``; a Kubeflow step lets
the exception end the task, so the run shows the message rather than an exit status.
"""

from __future__ import annotations


class StageError(Exception):
    """A stage could not do its work; ``str(err)`` says why in one line."""

    exit_code = 2
    details: str | None = None  # printed before the message by the CLI (a report, a list of problems)
