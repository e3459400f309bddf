"""The ``cloob`` command: parsing and printing only. One module per command group (config, data, train, eval,
experiment, promote), each with its parser and its handlers; a handler builds the typed inputs of one stage
function of cloob_core, calls it and prints its result. DVC stages run these commands, and the Kubeflow steps call
the same stage functions directly (cloob_core.ops.kubeflow). This module assembles the parser and turns a failure
into its exit status and one line."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Sequence

from cloob_core import __version__
from cloob_core.cli import config, data, experiment, promote, train
from cloob_core.cli import eval as evaluation
from cloob_core.errors import StageError, fail, user_facing
from cloob_core.parent import end_with_parent
from cloob_core.threads import limit_spinning

COMMAND_GROUPS = (config, data, train, evaluation, experiment, promote)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cloob", description="CLOOB contrastive image-text pretraining: every pipeline stage as a subcommand.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, third-party libraries' INFO lines included")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in COMMAND_GROUPS:
        group.add_commands(sub)
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
    end_with_parent()  # an evaluation started by a training run ends with it (cloob_core.parent)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said with the subcommand's usage, which lists its options, not the top level's
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
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


def run() -> None:
    """The ``cloob`` command as a process (its console script, ``python -m cloob_core.cli``): :func:`main`, then
    the exit without Python's finalization of every module, which costs a process that imported torch and
    open_clip about 2 s on CI's two cores (``import torch, open_clip`` then exit: 9.1 s, 6.8 s without it), paid
    by every DVC stage and training rank. The exit handlers run first and the streams are flushed; a process with a
    thread of its own still running (a checkpoint upload) ends the usual way, after it."""
    code = main()
    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()
           if thread is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()  # what the interpreter runs at exit before it finalizes its modules
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing more to say there
            stream.flush()
    os._exit(code)
