"""Content hashes that decide when engine pods must be replaced.

`service_version` (DESIGN §3) hashes model + quantization + dtype + scheduler policy (+ draft
model): what changes the answers or the scheduling contract. It is stamped on pods and announced on change.
`config_hash` covers the whole engine document, so a KV-cache or admission edit also rolls the
pods (the engine reads its config once, at start) without claiming a new service version.
Pure: hashlib and json only.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from magnitude.operator.spec import ModelServiceSpec

VERSION_LENGTH = 10


def _digest(document: Any) -> str:
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:VERSION_LENGTH]


def service_version(spec: ModelServiceSpec) -> str:
    """A short stable hash of what defines the service's behaviour."""
    return _digest(
        {
            # Fields added later count only when set, so an upgrade of the operator rolls nothing.
            "model": {k: v for k, v in spec.model.to_document().items()
                      if k in ("source", "revision") or v is not None},
            "quantization": spec.quantization,
            "draftModel": spec.draft_model.to_document() if spec.draft_model else None,
            "scheduler": spec.scheduler.to_document(),
            # Only when set: `auto` hashes as before the field existed, so an upgrade rolls nothing.
            **({"dtype": spec.dtype} if spec.dtype != "auto" else {}),
        }
    )


def config_hash(engine_document: dict[str, Any]) -> str:
    """A short stable hash of the engine config document."""
    return _digest(engine_document)
