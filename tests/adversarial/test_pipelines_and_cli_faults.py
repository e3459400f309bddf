"""`python -m pipelines` against endpoints that never answer, refuse connections or fail every request, and the
`cloob` command's last line of defence: whatever goes wrong, one line and an exit status, the traceback only
with --verbose."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from hostile import Outcome, cli
from json_api_server import JsonApiServer

from pipelines.__main__ import main as pipelines_main

REPO = Path(__file__).resolve().parents[2]


def pipelines(capsys, *argv: str) -> Outcome:
    code = pipelines_main([str(a) for a in argv])
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("package") / "pipeline.yaml"
    assert pipelines_main(["compile", "--output", str(path)]) == 0
    return path


@pytest.fixture
def silent_endpoint():
    """Accepts connections and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


class FailingApi(JsonApiServer):
    """Healthy, and failing every request."""

    def _answer(self, method: str, path: str, query: str, body: dict) -> tuple[int, dict]:
        if path.endswith("/healthz"):
            return 200, {"multi_user": False}
        return 500, {"error": "database is locked", "code": 13}


SUBMIT = ["--run-name", "nightly", "--params", str(REPO / "params.yaml"), "--set", "promote.store=s3://cloob/registry"]


def test_submit_to_an_endpoint_that_never_answers_ends_at_the_deadline(capsys, package, silent_endpoint):
    started = time.monotonic()
    done = pipelines(capsys, "submit", "--host", silent_endpoint, "--package", package, "--timeout", "2", *SUBMIT)
    assert time.monotonic() - started < 10
    assert done.code == 2 and "did not answer" in done.error_line("pipelines")


def test_schedule_to_an_endpoint_that_never_answers_ends_at_the_deadline(capsys, silent_endpoint):
    started = time.monotonic()
    done = pipelines(capsys, "schedule", "list", "--host", silent_endpoint, "--timeout", "2")
    assert time.monotonic() - started < 10
    assert done.code == 2 and "did not answer" in done.error_line("pipelines")


def test_submit_to_a_closed_port_is_one_line(capsys, package):
    with socket.create_server(("127.0.0.1", 0)) as probe:
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    done = pipelines(capsys, "submit", "--host", closed, "--package", package, "--timeout", "20", *SUBMIT)
    assert done.code == 2 and f"cannot reach {closed}" in done.error_line("pipelines")


def test_an_endpoint_failing_every_request_is_one_line(capsys, package):
    with FailingApi() as api:
        done = pipelines(capsys, "submit", "--host", api.url, "--package", package, *SUBMIT)
    line = done.error_line("pipelines")
    assert done.code == 2 and "HTTP 500" in line and "database is locked" in line


def test_a_missing_package_is_named_before_anything_is_sent(capsys, tmp_path):
    with FailingApi() as api:
        done = pipelines(capsys, "submit", "--host", api.url, "--package", tmp_path / "none.yaml", *SUBMIT)
        assert not api.requests
    assert done.code == 2 and "none.yaml does not exist" in done.error_line("pipelines")


def test_a_bad_configuration_is_refused_before_anything_is_sent(capsys, package):
    with FailingApi() as api:
        done = pipelines(capsys, "submit", "--host", api.url, "--package", package, *SUBMIT, "--set",
                         "train.batch_size=many")
        assert not api.requests
    assert done.code == 2 and "train.batch_size" in done.error_line("pipelines")


def test_compile_into_a_folder_is_one_line(capsys, tmp_path):
    done = pipelines(capsys, "compile", "--output", tmp_path)
    assert done.code == 2 and "is a folder" in done.error_line("pipelines")
    assert list(tmp_path.iterdir()) == []  # no temporary file left beside it


def test_an_internal_error_is_one_line_and_verbose_shows_the_traceback(capsys, monkeypatch):
    from cloob_core.cli import config as config_command

    def broken() -> str:
        raise RuntimeError("an invariant broke")

    monkeypatch.setattr(config_command, "dump_defaults", broken)
    done = cli(capsys, "config")
    line = done.error_line(internal=True)
    assert done.code == 1 and "RuntimeError: an invariant broke" in line and "--verbose" in line
    done = cli(capsys, "--verbose", "config")
    assert done.code == 1 and "Traceback (most recent call last)" in done.err and "an invariant broke" in done.err


def test_a_lookup_that_fails_in_our_code_is_a_defect_and_in_a_library_a_users_mistake(capsys, monkeypatch):
    """Our code checks the user's keys before it looks them up, so a KeyError raised in it is a defect (exit 1,
    with the hint to report it); one raised in a library is about the input it was given (exit 2)."""
    import functools
    import os

    from cloob_core.cli import config as config_command
    from cloob_core.training import sample_cache

    monkeypatch.setattr(config_command, "dump_defaults", functools.partial(sample_cache._first, {}, ("jpg",)))
    done = cli(capsys, "config")
    assert done.code == 1 and "KeyError" in done.error_line(internal=True)
    monkeypatch.setattr(config_command, "dump_defaults", functools.partial(os.environ.__getitem__, "CLOOB_NO_SUCH"))
    done = cli(capsys, "config")
    assert done.code == 2 and "CLOOB_NO_SUCH" in done.error_line(internal=False)


def test_an_error_re_raised_from_a_data_loader_worker_is_its_last_line():
    from cloob_core.errors import one_line

    wrapped = OSError("Caught OSError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
                      '  File "x.py", line 1, in f\nOSError: image file is truncated (3 bytes not processed)')
    assert one_line(wrapped) == "OSError: image file is truncated (3 bytes not processed)"
    assert len(one_line(ValueError("x" * 10_000))) <= 400
