"""The failures a stage reports to its caller: a user can act on each, so each carries a message, not a traceback.

Every stage function raises a subclass of :class:`StageError` when it cannot do its work. The ``cloob`` CLI
prints the message (and the ``details``, e.g. a gate's report) and exits with ``exit_code``; a Kubeflow step lets
the exception end the task, so the run shows the message rather than an exit status.
"""

from __future__ import annotations

import errno
import sys
import traceback

from cloob_core.redact import redacted

_MAX_LINE = 400


class StageError(Exception):
    """A stage could not do its work; ``str(err)`` says why in one line."""

    exit_code = 2
    details: str | None = None  # printed before the message by the CLI (a report, a list of problems)


def user_facing(err: BaseException) -> bool:
    """A bad input or environment the user can fix (a missing or unreadable file, a value, S3 access), as
    opposed to a defect in this project. A lookup that fails in our own code (a ``KeyError`` of a dict we
    built) is a defect: our code checks the user's keys before it looks them up."""
    if isinstance(err, LookupError) and _raised_in_our_code(err):
        return False
    from_libraries = ("botocore", "boto3", "PIL", "tarfile", "urllib3", "kfp_server_api", "yaml", "pydantic")
    return isinstance(err, (ValueError, OSError, EOFError, LookupError)) or type(err).__module__.split(".")[0] in (
        from_libraries)


def _raised_in_our_code(err: BaseException) -> bool:
    """Whether the innermost frame of ``err``'s traceback is a module of cloob_core."""
    frame = err.__traceback__
    if frame is None:
        return False
    while frame.tb_next is not None:
        frame = frame.tb_next
    return str(frame.tb_frame.f_globals.get("__name__", "")).split(".")[0] == "cloob_core"


def no_space(err: BaseException) -> bool:
    """Whether ``err`` is a write that ran out of space or quota."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def one_line(err: BaseException) -> str:
    """The message of ``err`` as one line: the last line of an exception a data-loader worker re-raised with its
    traceback inside, the lines joined otherwise; cut at a readable length."""
    if no_space(err):  # one that io.naming_full_disk did not name
        return "no space left on device" + (f" writing {err.filename}" if err.filename else "")
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if "Traceback (most recent call last)" in str(err):
        text = lines[-1]
    else:  # a message that lists items on lines of their own: "… mix them:\n  a: 1 before, 2 now\n  b: …"
        text = lines[0]
        for line in lines[1:]:
            text += (" " if text.endswith(":") else "; ") + line
    if not isinstance(err, (StageError, ValueError, OSError)) and not text.startswith(type(err).__name__):
        text = f"{type(err).__name__}: {text}"
    return text if len(text) <= _MAX_LINE else text[: _MAX_LINE - 1] + "…"


def fail(err: BaseException, verbose: bool, exit_code: int, message: str | None = None,
         program: str = "cloob") -> int:
    """Print why a command failed as one line on stderr (the traceback too with ``--verbose``); the exit code."""
    if verbose:
        traceback.print_exception(err, file=sys.stderr)
    line = redacted(message or one_line(err))  # a refusal may quote a URL with credentials (cloob_core.redact)
    if exit_code == 1 and not isinstance(err, StageError):  # not the user's mistake (a failed gate exits 1 too)
        line += " (an internal error; run with --verbose for the traceback, and report it)"
    # one write of the whole line: print() writes the text and the newline apart, so on an unbuffered stderr
    # (PYTHONUNBUFFERED) the lines of several ranks sharing one pipe interleaved into one
    sys.stderr.write(f"{program}: {line}\n")
    sys.stderr.flush()
    return exit_code
