"""Command-line flags generated from a pydantic settings model: one ``--flag`` per field, its help text and
default taken from the field, so a setting is documented and defaulted in one place whichever command shows it."""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any

import yaml
from pydantic import BaseModel


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel], prefix: str, title: str,
                    skip: tuple[str, ...] = ()) -> None:
    """Flags for ``model``'s fields, each with ``dest`` ``PREFIX__FIELD`` and default ``None`` (unset)."""
    group = parser.add_argument_group(title)
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        annotation = field.annotation
        args = typing.get_args(annotation)
        words: tuple[str, ...] = ()
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            members = [a for a in args if a is not type(None)]
            literals = [a for a in members if typing.get_origin(a) is typing.Literal]
            if literals and len(members) == 2:  # e.g. int | Literal["auto"]: a number or one of the words
                words = typing.get_args(literals[0])
                members.remove(literals[0])
            annotation = members[0]
            args = typing.get_args(annotation)
        # argparse %-formats help: a literal % in a description (e.g. "5%") must reach it doubled
        help_text = f"{field.description} (default: {field.get_default(call_default_factory=True)})".replace("%", "%%")
        options: dict[str, Any] = {"dest": f"{prefix}__{name}", "default": None, "help": help_text}
        if words:
            options.update(type=_word_or(annotation, words), metavar="|".join((*words, name.upper())))
        elif annotation is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is typing.Literal:
            options["choices"] = list(args)
        elif typing.get_origin(annotation) is list:  # repeatable, one item each (words: also comma-separated)
            item = args[0] if args and args[0] in (str, int, float) else _yaml_value  # e.g. a shard source mapping
            how = "Repeat the flag, or separate items by commas" if item is str else "Repeat the flag for each item"
            options.update(type=item, metavar=name.upper(), action="append",
                           help=help_text.replace(" (default:", f" {how} (default:", 1))
        elif typing.get_origin(annotation) is dict:  # repeatable KEY=VALUE, or one JSON object
            options.update(type=_mapping_of(args[1] if len(args) == 2 else Any), metavar="KEY=VALUE|JSON",
                           action="append")
        else:
            options["type"] = annotation
            options["metavar"] = name.upper()
        group.add_argument("--" + name.replace("_", "-"), **options)


def _yaml_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: not YAML ({' '.join(str(err).split())[:120]})") from None


def _word_or(kind: type, words: tuple[str, ...]) -> Any:
    def parse(text: str) -> Any:
        return text if text in words else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


class _KeyValues(dict):
    """One item of a mapping flag: the repeated items merge into one mapping (:func:`flag_values`)."""


def _mapping_of(value_type: Any) -> Any:
    """The parser of one KEY=VALUE (or a JSON object) for a mapping of ``value_type``: with text values the VALUE
    is kept as written (``rdma/rdma_shared_device_a=1`` is the text "1", ``NCCL_IB_DISABLE=0`` the text "0"),
    otherwise it is read as YAML."""
    def parse(text: str) -> dict[str, Any]:
        if text.lstrip().startswith("{"):
            try:
                mapping = json.loads(text)
            except json.JSONDecodeError as err:
                raise argparse.ArgumentTypeError(f"{text!r}: not a JSON object ({err})") from None
            if not isinstance(mapping, dict):
                raise argparse.ArgumentTypeError(f"{text!r}: not a JSON object")
            if value_type is str:  # a JSON number or boolean as the text it is in the environment or a label
                return _KeyValues({key: value if isinstance(value, str) else json.dumps(value)
                                   for key, value in mapping.items()})
            return _KeyValues(mapping)
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE or a JSON object")
        return _KeyValues({key: value if value_type is str else yaml.safe_load(value)})

    parse.__name__ = "KEY=VALUE"  # argparse names the type in its error
    return parse


def flag_values(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The flags of :func:`add_model_flags` that were given, as ``{field: value}`` (a repeated mapping flag's
    items merged, a repeated list flag's items in order)."""
    values = {}
    for dest, value in vars(args).items():
        head, _, name = dest.partition("__")
        if head == prefix and value is not None:
            if isinstance(value, list) and value and all(isinstance(item, _KeyValues) for item in value):
                value = {k: v for item in value for k, v in item.items()}  # KEY=VALUE flags: one mapping
            elif isinstance(value, list):  # a list flag: each item, a YAML list's items in place
                value = [part for item in value for part in (item if isinstance(item, list) else [item])]
            values[name] = value
    return values
