"""What every section of the configuration shares: its base model, its error, and how a validation error reads."""

from __future__ import annotations

import reprlib

from pydantic import BaseModel, ConfigDict, ValidationError

from cloob_core.errors import StageError


class ConfigError(StageError, ValueError):
    """A configuration that cannot run, with the offending key named."""


class _Section(BaseModel):
    # no NaN or infinity in any number: a NaN floor or tolerance compares false with everything and so holds nothing
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


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
