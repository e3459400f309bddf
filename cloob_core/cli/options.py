"""Options several commands share: where the configuration comes from (``--params``, ``--set``, one flag per field
of a section) and how a command reads it."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any

from cloob_core.config import CloobConfig, ConfigLayers, load_layers
from cloob_core.flags import add_model_flags, flag_values


def add_command(commands: argparse._SubParsersAction, name: str, handler: Callable[[argparse.Namespace], int],
                summary: str, description: str | None = None) -> argparse.ArgumentParser:
    """The subcommand ``name``, run by ``handler``. Its ``--help`` describes it with the handler's docstring unless
    ``description`` is given, so what a command does is written once, on the function that does it."""
    parser = commands.add_parser(name, help=summary, description=description or inspect.getdoc(handler) or summary)
    parser.set_defaults(func=handler, command_parser=parser)  # its usage, for an error in its arguments
    return parser


def add_config_options(parser: argparse.ArgumentParser, *sections: str, manifest_columns: bool = False) -> None:
    """--params and --set; one ``--flag`` per field of each of ``sections`` (a given flag overrides both); with
    ``manifest_columns``, --url-col, --caption-col and --input-format: how a manifest's parts are read."""
    parser.add_argument("--params", metavar="PATH",
                        help="YAML file with config sections (e.g. params.yaml); defaults are used where it is silent")
    parser.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                        help="override one value, e.g. --set train.objective=clip (repeatable)")
    for section in sections:
        _add_section_flags(parser, section)
    if manifest_columns:
        kept = ("url_col", "caption_col", "input_format")
        _add_section_flags(parser, "download", skip=tuple(
            name for name in CloobConfig.model_fields["download"].annotation.model_fields if name not in kept))


def _add_section_flags(parser: argparse.ArgumentParser, section: str, skip: tuple[str, ...] = ()) -> None:
    add_model_flags(parser, CloobConfig.model_fields[section].annotation, f"cfg.{section}",
                    f"{section} settings (config section '{section}')", skip)


def config_of(args: argparse.Namespace, preset: str | None = None) -> CloobConfig:
    """Defaults < --params < --preset < --set < the section flags, validated once."""
    return layers_of(args, preset).build()


def layers_of(args: argparse.Namespace, preset: str | None = None) -> ConfigLayers:
    """The configuration the command line gives, its layers apart (a resumed run lays them over its checkpoint's)."""
    flags: dict[str, dict[str, Any]] = {section: flag_values(args, f"cfg.{section}")
                                        for section in CloobConfig.model_fields}
    return load_layers(args.params, args.overrides, preset=preset, values=flags)


def _workers(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number of workers, got {text!r}")
    return int(text)


def add_model_source(parser: argparse.ArgumentParser) -> None:
    """The options that name a model to embed with (:class:`cloob_core.model.source.ModelSource`)."""
    parser.add_argument("--model", metavar="DIR|NAME", help="`cloob train` model folder (OUTPUT/model), local or "
                        "s3://; or an open_clip hf-hub:ORG/NAME or local-dir:PATH")
    parser.add_argument("--architecture", help="open_clip config name (with --weights instead of --model)")
    parser.add_argument("--weights", metavar="FILE", help="state-dict file for --architecture")
    parser.add_argument("--checkpoint", metavar="FILE", help="a `cloob train` checkpoint (OUTPUT/checkpoints/"
                        "step-N.pt, local or s3://): the model as it was at that step")


def model_source_of(args: argparse.Namespace) -> Any:
    """The :class:`ModelSource` that :func:`add_model_source`'s and :func:`add_output_and_device`'s options name."""
    from cloob_core.model.source import ModelSource

    return ModelSource(args.model, args.architecture, args.weights, args.device, args.checkpoint, args.precision)


def add_output_and_device(parser: argparse.ArgumentParser, output: str) -> None:
    parser.add_argument("--output", default=output, help=f"results folder (default: {output})")
    add_device(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_device(parser: argparse.ArgumentParser) -> None:
    """Where and how a model embeds: --device, --precision, and the image loader's --workers."""
    parser.add_argument("--device", default="auto",
                        help="auto (a usable GPU, else the CPU), cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                        help="embedding precision: auto is bf16 autocast on a GPU (fp16 before Ampere), fp32 on the "
                             "CPU (default: auto)")
    parser.add_argument("--workers", type=_workers, default=None, metavar="N",
                        help="data-loader workers decoding images (default: from the cores; 0: none)")
