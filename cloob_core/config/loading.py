"""A configuration from its layers: the defaults, a params file, a preset, ``section.key=value`` overrides and typed
flag values, validated once."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cloob_core.config.base import ConfigError, describe
from cloob_core.config.root import PRESETS, CloobConfig


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping: PyYAML keeps the last silently, which would drop a
    data set of the evaluation suite (they are keyed by name) without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw)


Values = Mapping[str, Mapping[str, Any]]  # {section: {key: value}}, typed values (a command's flags)


@dataclass(frozen=True)
class ConfigLayers:
    """A configuration as its caller gave it, the layers kept apart: a params file's sections, a preset,
    ``section.key=value`` overrides, typed flag values. :meth:`build` lays them over the defaults (or over a base,
    such as a checkpoint's configuration); :meth:`keys` says which keys the caller set."""

    data: Mapping[str, Any] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()
    preset: str | None = None
    values: Values | None = None

    def build(self, base: Mapping[str, Any] | None = None) -> CloobConfig:
        return config_from_mapping(_merged(base or {}, self.data), self.overrides, self.preset, self.values)

    def keys(self) -> set[str]:
        """The ``section.key`` names the layers set (a params file's every key included)."""
        named = {f"{section}.{key}" for section, fields in self.data.items() if isinstance(fields, Mapping)
                 for key in fields}
        named |= set(PRESETS.get(self.preset, {})) if self.preset else set()
        named |= {".".join(_parse_override(text)[0][:2]) for text in self.overrides}
        named |= {f"{section}.{key}" for section, fields in (self.values or {}).items() for key in fields}
        return named


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` section by section (a section ``over`` names replaces only the keys it gives)."""
    merged = copy.deepcopy(dict(base))
    for section, fields in over.items():
        if isinstance(fields, Mapping) and isinstance(merged.get(section), Mapping):
            merged[section] = {**merged[section], **copy.deepcopy(dict(fields))}
        else:
            merged[section] = copy.deepcopy(fields)
    return merged


def load_layers(path: str | Path | None = None, overrides: Sequence[str] = (), preset: str | None = None,
                values: Values | None = None) -> ConfigLayers:
    """The layers of :func:`load_config`, the YAML file at ``path`` read and parsed, nothing validated yet."""
    text = None
    if path is not None:
        try:
            with open(path, "rb") as handle:  # no more than the bound read: the file may be any size
                text = handle.read(MAX_CONFIG_BYTES + 1).decode("utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path} is not UTF-8 text (is it a YAML file?)") from None
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return ConfigLayers(_parsed(text, f"config file {path}"), tuple(overrides), preset, values)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), preset: str | None = None,
                values: Values | None = None) -> CloobConfig:
    """Defaults, then the YAML file at ``path`` (if given), then a named preset, then ``section.key=value``
    overrides (text, as ``--set`` gives them), then ``values``; validated once, at the end."""
    return load_layers(path, overrides, preset, values).build()


def config_from_text(text: str | None, overrides: Sequence[str] = (), preset: str | None = None,
                     source: str = "the parameters", values: Values | None = None) -> CloobConfig:
    """:func:`load_config` for a params.yaml given as text (a Kubeflow run parameter); ``None``: the defaults."""
    return config_from_mapping(_parsed(text, source), overrides, preset, values)


MAX_CONFIG_BYTES = 1 << 20  # a params.yaml is a few KiB; PyYAML reads about 0.25 MB/s of a long list
MAX_CONFIG_VALUES = 100_000  # values in a configuration, each alias counted as the values it stands for


def _parsed(text: str | None, source: str) -> dict[str, Any]:
    if text is None:
        return {}
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source} holds over {MAX_CONFIG_BYTES:,} characters, the most a configuration may have "
                          "(a params.yaml is a few thousand)")
    loader = _UniqueKeyLoader(text)  # a SafeLoader
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_CONFIG_VALUES:
            raise ConfigError(f"{source}: its YAML aliases expand to over {MAX_CONFIG_VALUES:,} values (an alias "
                              "repeated inside another alias?); a configuration has far fewer")
        loaded = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source} is not valid YAML: {err}") from None
    except RecursionError:
        raise ConfigError(f"{source}: its YAML nests deeper than Python's recursion limit") from None
    finally:
        loader.dispose()
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{source} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded or {}


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """The values ``node`` stands for once its aliases are expanded; an alias is the node it names, so a shared node
    is sized once (``sizes``) and a "billion laughs" of a few lines is sized in as many steps."""
    if id(node) not in sizes:
        sizes[id(node)] = 0  # a recursive alias (`&a [*a]`) counts once rather than forever
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        sizes[id(node)] = 1 + sum(_expanded_size(child, sizes) for child in children)
    return sizes[id(node)]


def config_from_mapping(data: Mapping[str, Any], overrides: Sequence[str] = (), preset: str | None = None,
                        values: Values | None = None) -> CloobConfig:
    """:func:`load_config` for the sections as a mapping (a configuration's ``model_dump()``, a KFP struct)."""
    merged = copy.deepcopy(dict(data))
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        for key, value in PRESETS[preset].items():
            _put(merged, key.split("."), value, key)
    for override in overrides:
        keys, value = _parse_override(override)
        _put(merged, keys, value, override)
    for section, fields in (values or {}).items():
        for key, value in fields.items():
            _put(merged, [section, key], value, f"{section}.{key}")
    try:
        return CloobConfig.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(describe(err)) from None


def _put(data: dict[str, Any], keys: list[str], value: Any, named: str) -> None:
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {named!r}: {key} is not a section")
        node = child
    node[keys[-1]] = value


def dump_defaults() -> str:
    """The defaults as YAML: what ``params.yaml`` holds."""
    header = "# The DVC view of cloob_core.config. Descriptions and sources: cloob_core/config/.\n"
    return header + yaml.safe_dump(CloobConfig().model_dump(), sort_keys=False)
