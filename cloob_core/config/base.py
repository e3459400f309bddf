"""What every section of the configuration shares: its base model, its error, and how a validation error reads."""

from __future__ import annotations

import reprlib
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from cloob_core.errors import StageError


class ConfigError(StageError, ValueError):
    """A configuration that cannot run, with the offending key named."""


# The largest magnitudes a setting may have, whatever its own bounds (a field may bound itself tighter): past them
# the code's arithmetic fails where no one reads the setting's name: a factor of 1e308 times a step count is
# infinity, which no step count is; an integer past 2**53 is not exact as a float, past 2**63 not a tensor's; a wait
# past threading's TIMEOUT_MAX (about 292 years) is an OverflowError.
MAX_FLOAT = 1e12
MAX_INT = 2**53
MAX_SECONDS = 1e9  # a setting in seconds (its name ends in _s): 31 years


class _Section(BaseModel):
    # no NaN or infinity in any number: a NaN floor or tolerance compares false with everything and so holds nothing
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _listed(cls, value: Any, info: ValidationInfo) -> Any:
        """A list of words given as one string, or as strings with commas (``--set curation.languages=en``,
        ``en,de``, ``--languages en,de``): their comma-separated items."""
        if not info.field_name or not _is_word_list(cls.model_fields[info.field_name].annotation):
            return value
        given = [value] if isinstance(value, str) else value
        if isinstance(given, list) and all(isinstance(item, str) for item in given):
            return [part.strip() for item in given for part in item.split(",") if part.strip()]
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _computable(cls, value: Any, info: ValidationInfo) -> Any:
        """Every number of every section, in lists and maps too, within what the code computes with."""
        for number in _numbers(value):
            bound = MAX_SECONDS if (info.field_name or "").endswith("_s") else \
                MAX_INT if isinstance(number, int) else MAX_FLOAT
            if abs(number) > bound:
                most = f"{bound:g} seconds" if bound == MAX_SECONDS else f"{bound:g} in magnitude"
                raise ValueError(f"{number!r} is past what the code computes with (at most {most})")
        return value


def _is_word_list(annotation: Any) -> bool:
    """``list[str]`` or ``list[str] | None``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(annotation) if member is not type(None)]
        annotation = members[0] if len(members) == 1 else None
    return typing.get_origin(annotation) is list and typing.get_args(annotation) == (str,)


def _numbers(value: Any) -> list[int | float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [number for item in value for number in _numbers(item)]
    if isinstance(value, dict):
        return [number for item in value.values() for number in _numbers(item)]
    return []


def describe(err: ValidationError, what: str = "configuration") -> str:
    """A pydantic error as one line that names each offending key (its value cut short: it may be huge)."""
    lines = []
    for problem in err.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "<root>"
        if problem["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        elif problem["type"] == "value_error":  # our own checks: their message says what was wrong
            message = problem["msg"].removeprefix("Value error, ")
            named = key == "<root>" or message.startswith(f"{key}.")  # the message names its keys itself
            lines.append(message if named else f"{key}: {message}")
        else:
            lines.append(f"{key}: {problem['msg']} (got {short_repr(problem.get('input'))})")
    return f"invalid {what}: " + "; ".join(lines)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 60, 60


def short_repr(value: object, limit: int = 80) -> str:
    """``value`` as a short repr, never formatted whole: a value built by YAML aliases may expand to billions of
    items, while its containers are few objects (reprlib stops at a few items per level)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
