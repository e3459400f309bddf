"""The `cloob` command itself: it lists its stages, prints the configuration, and a bad configuration is one
line on stderr with exit status 2 before anything is written."""

import subprocess
import sys

import yaml

from cloob_core.cli import main
from cloob_core.config import load_config


def test_cli_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "cloob_core.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert all(command in out.stdout for command in ("config", "data", "train", "eval", "promote"))


def test_cli_config_prints_params_yaml_defaults(capsys):
    assert main(["config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == load_config().model_dump()


def test_cli_rejects_bad_config_with_exit_2(capsys, tmp_path):
    assert main(["train", "--output", str(tmp_path), "--set", "train.objective=simclr"]) == 2
    error = capsys.readouterr().err
    assert "train.objective" in error and "Traceback" not in error
    assert not any(tmp_path.iterdir())  # nothing was written


def test_an_unknown_option_is_told_with_the_subcommands_usage(capsys):
    import pytest

    with pytest.raises(SystemExit) as exited:
        main(["eval", "linear-probe", "--bogus", "1"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("usage: cloob eval linear-probe")
    assert "unrecognized arguments: --bogus 1" in err


def test_every_task_takes_its_images_as_data():
    from cloob_core.cli import build_parser

    for task in ("zeroshot", "linear-probe", "retrieval", "diagnostics"):
        args = build_parser().parse_args(["eval", task, "--data", "mnist"])
        assert (args.train_data if task == "linear-probe" else args.data) in ("mnist", ["mnist"])


def test_every_command_that_reads_a_table_names_its_columns_with_the_same_flags():
    from cloob_core.cli import build_parser

    parser = build_parser()
    for argv in (["data", "acquire", "--output", "o"], ["data", "shards", "--source", "s", "--output", "o"],
                 ["data", "validate"]):
        args = vars(parser.parse_args([*argv, "--url-col", "file", "--caption-col", "text"]))
        assert (args["cfg.download__url_col"], args["cfg.download__caption_col"]) == ("file", "text"), argv
    args = parser.parse_args(["data", "eval-set", "--source", "s", "--output", "o", "--url-col", "file",
                              "--caption-col", "text"])
    assert (args.image_col, args.caption_col) == ("file", "text")


def _commands(parser, prefix=()):
    """Every command path of the parser (``("eval", "zeroshot")``, …) with its parser."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from _commands(sub, (*prefix, name))


def test_every_commands_help_prints(capsys):
    """`cloob COMMAND --help` and `python -m pipelines COMMAND --help` for each command and subcommand: a
    configuration field's description with a literal % (the promotion floor's "5%") once made argparse's help
    formatting fail with a traceback."""
    import pytest

    from cloob_core.cli import build_parser
    from pipelines.__main__ import build_parser as pipelines_parser
    from pipelines.__main__ import main as pipelines_main

    for program, run, parser, named in (
            ("cloob", main, build_parser(), {("promote",), ("eval", "zeroshot"), ("data", "acquire"), ("train",)}),
            ("python -m pipelines", pipelines_main, pipelines_parser(), {("compile",), ("schedule", "create")})):
        commands = dict(_commands(parser))
        assert named <= commands.keys()
        for command in [(), *commands]:
            with pytest.raises(SystemExit) as exited:
                run([*command, "--help"])
            assert exited.value.code == 0, command
            assert capsys.readouterr().out.startswith(f"usage: {' '.join((program, *command))}"), command


def test_a_refusal_line_is_one_write(monkeypatch):
    """Several ranks share one stderr pipe: the line goes out in one write (atomic on a pipe up to 4 KiB), so two
    ranks' refusals never interleave into one line, as they did with print() on an unbuffered stderr."""
    import io

    from cloob_core.errors import StageError, fail

    class Recording(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return super().write(text)

    stderr = Recording()
    monkeypatch.setattr(sys, "stderr", stderr)
    assert fail(StageError("train.objective: 'simclr' is not one of the objectives"), False, 2) == 2
    assert stderr.writes == ["cloob: train.objective: 'simclr' is not one of the objectives\n"]
