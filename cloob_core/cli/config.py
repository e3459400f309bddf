"""``cloob config``: print the typed configuration (the defaults are what params.yaml holds)."""

from __future__ import annotations

import argparse

from cloob_core.cli.options import add_command, add_config_options
from cloob_core.config import dump_defaults, load_config


def _config(args: argparse.Namespace) -> int:
    """Print the typed configuration as YAML. Without options: the defaults, which is what params.yaml holds. With
    --params/--set: the validated result."""
    if args.params or args.overrides:
        import yaml

        print(yaml.safe_dump(load_config(args.params, args.overrides).model_dump(), sort_keys=False), end="")
    else:
        print(dump_defaults(), end="")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "config", _config,
                         "print the configuration (defaults, or a params file with overrides applied)")
    add_config_options(parser)
