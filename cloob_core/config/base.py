"""What every section of the configuration shares: its base model, its error, and how a validation error reads."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from cloob_core.errors import StageError


class ConfigError(StageError, ValueError):
    """A configuration that cannot run, with the offending key named."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


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
            lines.append(f"{key}: {problem['msg']} (got {_short(repr(problem.get('input')))})")
    return f"invalid {what}: " + "; ".join(lines)


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
