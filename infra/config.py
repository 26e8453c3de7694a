"""Deriving validated configs: `a.b=c` assignments applied to any frozen pydantic config, re-validated.

The one way a recipe or a stage spec is changed after loading: `override(spec, "train.max_steps=200")` or
`override(spec, {"optim.lr": 1e-3})`. Strings are parsed as YAML (so 3, 1e-3, true, [1, 2] get their types);
mapping values are taken as they are. The result is validated by the config's own type.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

from infra.errors import UserError

M = TypeVar("M", bound=BaseModel)
Change = str | Mapping[str, Any]


class ConfigError(UserError, ValueError):
    """An invalid configuration; the message has one line per problem, each naming the field."""


def parse_override(override: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (["a", "b"], c) with c parsed as YAML."""
    key, sep, raw = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"override {override!r} must look like section.field=value, e.g. train.max_steps=200"
        )
    try:
        return key.split("."), yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as error:
        problem = str(getattr(error, "problem", None) or "not valid YAML")
        raise ConfigError(
            f"override {override!r}: the value is not valid YAML ({problem}); quote strings that start with "
            "* & ! or contain ': ', e.g. data.sources=['*.txt']"
        ) from None


def assignments(changes: Iterable[Change]) -> list[tuple[list[str], Any]]:
    """(path, value) pairs from `a.b=c` strings and {"a.b": value} mappings, in order."""
    pairs: list[tuple[list[str], Any]] = []
    for change in changes:
        if isinstance(change, str):
            pairs.append(parse_override(change))
        else:
            pairs.extend((key.split("."), value) for key, value in change.items())
    return pairs


def apply_overrides(data: dict[str, Any], changes: Iterable[Change]) -> dict[str, Any]:
    """A copy of plain `data` with each assignment applied; intermediate sections are created as needed."""
    result = json.loads(json.dumps(data))  # deep copy of plain JSON data
    for path, value in assignments(changes):
        node = result
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {'.'.join(path)}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = json.loads(json.dumps(value)) if isinstance(value, dict | list) else value
    return result


def override(config: M, *changes: Change) -> M:
    """`config` with the assignments applied, validated again by its own type (cross-field rules included)."""
    return type(config).model_validate(apply_overrides(config.model_dump(mode="json"), changes))
