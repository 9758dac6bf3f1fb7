"""Resolve the engine config document and apply `--set dotted.camelCase=value` overrides. Pure.

The same document is the engine's `--config`, the simulator's `--config` and the operator's
ConfigMap. Errors are `ConfigError`s whose message names the source and the key, so the CLI can
print them and exit 2. Reading a file is the CLI's job (`magnitude.cli.config_file`).
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from magnitude.policy.schema import EngineConfig


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


def _format_validation(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(document)"
        lines.append(f"{source}: {key}: {e['msg']}")
    return "\n".join(lines)


def _parse_value(text: str) -> Any:
    """YAML scalars: 16 -> int, 0.5 -> float, true/null, [a, b] -> list; anything else a string."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _alias_of(model: type[BaseModel], part: str) -> str | None:
    for name, f in model.model_fields.items():
        alias = f.alias or name
        if part in (alias, name):
            return alias
    return None


def _nested_model(model: type[BaseModel], alias: str) -> tuple[type[BaseModel] | None, bool]:
    """The pydantic model under a field (and whether the field is a list of them)."""
    for name, f in model.model_fields.items():
        if (f.alias or name) != alias:
            continue
        ann = f.annotation
        # An optional section (`draftModel: X | None`): its model is the non-None member.
        members = [a for a in getattr(ann, "__args__", ()) if a is not type(None)]
        if type(None) in getattr(ann, "__args__", ()) and len(members) == 1:
            ann = members[0]
        origin = getattr(ann, "__origin__", None)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            return ann, False
        if origin is list:
            (inner,) = ann.__args__  # type: ignore[union-attr]
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner, True
        return None, False
    return None, False


def apply_override(doc: dict, assignment: str) -> dict:
    """Apply one `dotted.camelCase.path=value` to a config document (in place, returned)."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. scheduler.tokenBudget=16")
    parts = key.split(".")
    model: type[BaseModel] | None = EngineConfig
    node: Any = doc
    resolved: list[str | int] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {key}: {part!r} is not an index of the list (length {len(node)})")
            idx = int(part)
            resolved.append(idx)
            if last:
                node[idx] = _parse_value(raw)
            else:
                node = node[idx]
            continue
        if model is None:
            raise ConfigError(f"--set {key}: unknown key {'.'.join(parts[: i + 1])!r}")
        alias = _alias_of(model, part)
        if alias is None:
            known = ", ".join(sorted((f.alias or n) for n, f in model.model_fields.items()))
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(f"--set {key}: unknown key {part!r} under {where} (known: {known})")
        if last:
            node[alias] = _parse_value(raw)
            break
        nested, is_list = _nested_model(model, alias)
        if nested is None:
            raise ConfigError(f"--set {key}: {alias!r} is a value, not a section")
        if alias not in node:
            # A list is edited by index: start from its default so `priorityClasses.0.priority` works.
            default = _default_document([*resolved, alias]) if is_list else {}
            node[alias] = default
        node = node[alias]
        resolved.append(alias)
        model = nested
    return doc


def _default_document(path: list[str | int]) -> Any:
    node: Any = EngineConfig().to_document()
    for part in path:
        node = node[part]
    return node


def resolve_config(doc: dict | None = None, overrides: list[str] | tuple[str, ...] = (),
                   source: str = "config") -> EngineConfig:
    """The resolved EngineConfig: defaults, then the document, then each `--set` in order.
    `source` names where the document came from, for error messages."""
    doc = {} if doc is None else doc
    try:
        EngineConfig.model_validate(doc)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source)) from e
    # Overrides edit the document as written (defaults stay unset, so they stay defaults).
    for assignment in overrides:
        apply_override(doc, assignment)
    try:
        return EngineConfig.model_validate(doc)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, "--set" if overrides else source)) from e
