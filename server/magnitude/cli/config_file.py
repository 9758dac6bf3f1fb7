"""Read an engine config file (YAML or JSON) for the CLI; resolving it is `magnitude.policy.load`."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from magnitude.policy.load import ConfigError, resolve_config
from magnitude.policy.schema import EngineConfig


def load_document(path: str | Path) -> dict:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror or e}") from e
    try:
        doc = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from e
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the config must be a mapping (scheduler, kvCache, admission, ...)")
    return doc


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> EngineConfig:
    """Defaults, then the file at `path` (if any), then each `--set` in order."""
    if not path:
        return resolve_config({}, overrides)
    return resolve_config(load_document(path), overrides, source=str(path))
