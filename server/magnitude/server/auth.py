"""Who is the caller: the auth modes, the API-keys document, and each request's tenant and class.

Owns the identity decision for `/v1` requests, free of FastAPI so that it is testable as plain
functions; `app.py` wraps it in one dependency and maps `AuthError` to the OpenAI error shape.

Modes (`--auth-mode`, `MAGNITUDE_AUTH_MODE`):

- `none`: no identity. The tenant (`X-Tenant`, else `user`, else `default`) and `priority_class`
  are the client's claims, believed as sent; the optional single `--api-key` only keeps strangers
  out, it says nothing about who the caller is.
- `apiKeys`: `Authorization: Bearer KEY` is required and the key decides: it maps to one tenant
  and the priority classes it may use (the keys file, `ApiKeysDocument`). The file is re-read when
  it changes (at most every `reload_interval_s`), so a mounted Secret rotates keys without a restart.
- `trustedGateway`: a gateway in front has authenticated the caller and says who it is in
  `X-Magnitude-Tenant` (required) and `X-Magnitude-Priority-Class` (optional); they are believed.

Rules shared by every mode, so one request means the same thing everywhere:

- The gateway headers are refused (400, naming the header) outside `trustedGateway`: a client
  must not be able to send what only a gateway may say, and a gateway in front of an engine not
  configured to trust it is a misconfiguration worth surfacing rather than silently ignoring.
- Where an identity is established (a key, the gateway), a client claim that agrees with it is
  accepted and one that conflicts is refused by name (403 `tenant_mismatch` naming `user` or
  `X-Tenant`; 403 `priority_class_mismatch` for a body class the gateway contradicts), never
  silently overridden: a caller learns at once that its claim was not what it got.
- A class a key may not use is refused with 403 `priority_class_forbidden` naming it.

Only SHA-256 digests of the keys are kept in memory, and a presented key is compared against every
digest with `hmac.compare_digest` (no early exit), so lookup time does not depend on which key
matched. The prefix cache is keyed by the decided tenant (`AsyncEngine.submit`'s `cache_key`), so a
caller cannot reach another tenant's cached prefixes once identity comes from a key or a gateway.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from magnitude.policy.load import ConfigError

log = logging.getLogger("magnitude.server.auth")

AUTH_MODES = ("none", "apiKeys", "trustedGateway")
GATEWAY_TENANT_HEADER = "X-Magnitude-Tenant"
GATEWAY_CLASS_HEADER = "X-Magnitude-Priority-Class"
MAX_TENANT_LEN = 253
MIN_KEY_LEN = 16  # a guessable key is no identity
MAX_KEYS_FILE_BYTES = 1 << 20  # re-read on every change: a bounded read
DEFAULT_RELOAD_INTERVAL_S = 2.0  # kubelet updates a mounted Secret within about a minute anyway
DEFAULT_TENANT = "default"


class AuthConfigError(ConfigError):
    """A bad auth setting or keys file; `magnitude serve` exits 2 with this message."""


class AuthError(Exception):
    """A refused request: HTTP status and the OpenAI error fields (`app.py` turns it into APIError)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


# -- the keys document ------------------------------------------------------------------------------
class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


class ApiKeyEntry(_Doc):
    key: str = Field(min_length=MIN_KEY_LEN, max_length=512, description="The bearer key, as clients send it.")
    tenant: str = Field(min_length=1, max_length=MAX_TENANT_LEN, pattern=r"^\S(.*\S)?$")
    priority_classes: list[str] | None = Field(
        default=None, min_length=1, description="Classes this key may use; omitted: every configured class."
    )
    default_priority_class: str | None = Field(
        default=None, description="Class for requests that name none; omitted: the engine's default if allowed, "
        "else the first of priorityClasses."
    )

    @model_validator(mode="after")
    def _default_is_allowed(self) -> "ApiKeyEntry":
        allowed = self.priority_classes
        if self.default_priority_class is not None and allowed is not None and self.default_priority_class not in allowed:
            raise ValueError(f"defaultPriorityClass {self.default_priority_class!r} is not one of priorityClasses {allowed}")
        return self


class ApiKeysDocument(_Doc):
    """The keys file (YAML or JSON), e.g. `{"keys": [{"key": "...", "tenant": "acme", "priorityClasses": ["batch"]}]}`."""

    keys: list[ApiKeyEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _keys_unique(self) -> "ApiKeysDocument":
        seen: dict[str, int] = {}
        for i, entry in enumerate(self.keys):
            if entry.key in seen:
                # A key naming two tenants would make identity depend on file order.
                raise ValueError(f"keys[{i}] repeats the key of keys[{seen[entry.key]}]")
            seen[entry.key] = i
        return self


@dataclass(frozen=True)
class Identity:
    """What an authenticated caller is: its tenant and the classes it may use (None: any)."""

    tenant: str
    priority_classes: tuple[str, ...] | None = None
    default_priority_class: str | None = None

    def class_for(self, engine_default: str) -> str:
        if self.default_priority_class is not None:
            return self.default_priority_class
        if self.priority_classes is None or engine_default in self.priority_classes:
            return engine_default
        return self.priority_classes[0]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_api_keys(text: str, known_classes: Sequence[str], source: str = "api keys file") -> list[tuple[bytes, Identity]]:
    """The keys document → (key digest, identity) pairs; AuthConfigError names the file and entry."""
    try:
        doc = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise AuthConfigError(f"{source}: not valid YAML or JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise AuthConfigError(f"{source}: must be a mapping with a 'keys' list")
    try:
        parsed = ApiKeysDocument.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        # Pydantic's message for a string field echoes the input; never print a key.
        raise AuthConfigError(f"{source}: {_where(tuple(first['loc'])) or 'keys'}: {first['msg']}") from None
    entries: list[tuple[bytes, Identity]] = []
    for i, e in enumerate(parsed.keys):
        for name in [*(e.priority_classes or []), *([e.default_priority_class] if e.default_priority_class else [])]:
            if name not in known_classes:
                raise AuthConfigError(f"{source}: keys[{i}]: unknown priority class {name!r}; known: {list(known_classes)}")
        classes = None if e.priority_classes is None else tuple(dict.fromkeys(e.priority_classes))
        entries.append((_digest(e.key), Identity(e.tenant, classes, e.default_priority_class)))
    return entries


class ApiKeyStore:
    """The keys file's identities, re-read when its content changes (checked at most every
    `reload_interval_s`, on lookup). A file that becomes unreadable or invalid keeps the last good
    keys and logs why: a half-written update must not lock every client out."""

    def __init__(
        self,
        path: str,
        known_classes: Sequence[str],
        reload_interval_s: float = DEFAULT_RELOAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.known_classes = list(known_classes)
        self.reload_interval_s = reload_interval_s
        self.clock = clock
        self._content_hash = b""
        self._entries: list[tuple[bytes, Identity]] = []
        self._checked_at = clock()
        self._load(initial=True)

    def _read(self) -> str:
        with open(self.path, "rb") as f:
            data = f.read(MAX_KEYS_FILE_BYTES + 1)
        if len(data) > MAX_KEYS_FILE_BYTES:
            raise AuthConfigError(f"{self.path}: larger than {MAX_KEYS_FILE_BYTES} bytes")
        return data.decode("utf-8", errors="replace")

    def _load(self, initial: bool = False) -> None:
        try:
            text = self._read()
        except OSError as exc:
            raise AuthConfigError(f"{self.path}: cannot read the api keys file: {exc.strerror or exc}") from exc
        # The content hash, not the mtime, decides: a Secret update swaps a symlink and a rewrite
        # within one mtime tick must still count.
        content_hash = hashlib.sha256(text.encode()).digest()
        if content_hash == self._content_hash:
            return
        self._entries = parse_api_keys(text, self.known_classes, self.path)
        self._content_hash = content_hash
        log.info("api keys %s from %s: %d keys", "loaded" if initial else "reloaded", self.path, len(self._entries))

    def _maybe_reload(self) -> None:
        now = self.clock()
        if now - self._checked_at < self.reload_interval_s:
            return
        self._checked_at = now
        try:
            self._load()
        except AuthConfigError as exc:
            log.error("api keys not reloaded, keeping the previous %d keys: %s", len(self._entries), exc)

    def lookup(self, key: str) -> Identity | None:
        self._maybe_reload()
        digest = _digest(key)
        found: Identity | None = None
        for candidate, identity in self._entries:
            if hmac.compare_digest(candidate, digest):  # no break: time does not say which entry matched
                found = identity
        return found


# -- the per-request decision -------------------------------------------------------------------------
@dataclass(frozen=True)
class Claims:
    """What the request says about itself; None where absent."""

    user: str | None = None  # body `user`
    x_tenant: str | None = None  # `X-Tenant` header
    priority_class: str | None = None  # body `priority_class`
    gateway_tenant: str | None = None  # `X-Magnitude-Tenant`
    gateway_class: str | None = None  # `X-Magnitude-Priority-Class`


@dataclass(frozen=True)
class Decision:
    """The tenant and class a request runs as; `class_param` names where the class came from,
    for the 400 on an unknown class."""

    tenant: str
    priority_class: str
    class_param: str = "priority_class"


def bearer_token(authorization: str | None) -> str | None:
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    return authorization[7:].strip() or None


def _clean(value: str | None) -> str | None:
    value = None if value is None else value.strip()
    return value or None


def _check_tenant(tenant: str, param: str) -> str:
    if len(tenant) > MAX_TENANT_LEN:
        raise AuthError(400, f"tenant ({param}) longer than {MAX_TENANT_LEN} characters", param=param)
    return tenant


def _refuse_conflicting_tenant(tenant: str, claims: Claims, source: str) -> None:
    for param, value in (("X-Tenant", claims.x_tenant), ("user", claims.user)):
        claimed = _clean(value)
        if claimed is not None and claimed != tenant:
            raise AuthError(
                403,
                f"{param} {claimed!r} conflicts with the tenant {tenant!r} of this {source}; "
                f"omit {param} or send the same tenant",
                param=param,
                code="tenant_mismatch",
            )


def _invalid_key() -> AuthError:
    return AuthError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


class Authenticator:
    """One mode's checks: `authenticate` (the bearer header, for every /v1 route) and `decide`
    (tenant and class, for the generation routes)."""

    def __init__(self, mode: str = "none", *, api_key: str | None = None, store: ApiKeyStore | None = None) -> None:
        self.mode = mode
        self.api_key = api_key
        self.store = store

    @classmethod
    def build(
        cls,
        mode: str | None,
        api_key: str | None,
        api_keys_file: str | None,
        known_classes: Sequence[str],
        reload_interval_s: float = DEFAULT_RELOAD_INTERVAL_S,
    ) -> "Authenticator":
        """Validates the combination; AuthConfigError names the flag (and its env variable)."""
        mode = mode or "none"
        if mode not in AUTH_MODES:
            raise AuthConfigError(f"--auth-mode (MAGNITUDE_AUTH_MODE): {mode!r} is not one of {list(AUTH_MODES)}")
        if mode == "apiKeys":
            if not api_keys_file:
                raise AuthConfigError("--auth-mode apiKeys needs --api-keys-file (MAGNITUDE_API_KEYS_FILE)")
            if api_key:
                raise AuthConfigError(
                    "--api-key (MAGNITUDE_API_KEY) cannot be combined with --auth-mode apiKeys: "
                    "put the key in --api-keys-file with its tenant"
                )
            return cls(mode, store=ApiKeyStore(api_keys_file, known_classes, reload_interval_s))
        if api_keys_file:
            raise AuthConfigError(f"--api-keys-file (MAGNITUDE_API_KEYS_FILE) is only read with --auth-mode apiKeys, not {mode}")
        return cls(mode, api_key=api_key)

    def authenticate(self, authorization: str | None) -> Identity | None:
        """The caller's identity (apiKeys), or None where the mode has none; AuthError 401 otherwise."""
        token = bearer_token(authorization)
        if self.store is not None:
            identity = None if token is None else self.store.lookup(token)
            if identity is None:
                raise _invalid_key()
            return identity
        if self.api_key and (token is None or not hmac.compare_digest(token.encode(), self.api_key.encode())):
            raise _invalid_key()
        return None

    def decide(self, identity: Identity | None, claims: Claims, default_class: str) -> Decision:
        """The tenant and class this request runs as, or AuthError naming the refused claim."""
        if self.mode == "trustedGateway":
            return self._from_gateway(claims, default_class)
        for header, value in ((GATEWAY_TENANT_HEADER, claims.gateway_tenant), (GATEWAY_CLASS_HEADER, claims.gateway_class)):
            if value is not None:
                raise AuthError(
                    400,
                    f"{header} is only accepted from a trusted gateway (--auth-mode trustedGateway); this server runs "
                    f"--auth-mode {self.mode}",
                    param=header,
                    code="untrusted_header",
                )
        if self.mode == "none":  # the claims are all there is
            tenant = _clean(claims.x_tenant) or _clean(claims.user) or DEFAULT_TENANT
            return Decision(_check_tenant(tenant, "X-Tenant" if _clean(claims.x_tenant) else "user"), claims.priority_class or default_class)
        if identity is None:  # apiKeys: a route that skipped `authenticate` must not fall back to claims
            raise _invalid_key()
        _refuse_conflicting_tenant(identity.tenant, claims, "API key")
        priority_class = claims.priority_class or identity.class_for(default_class)
        if identity.priority_classes is not None and priority_class not in identity.priority_classes:
            raise AuthError(
                403,
                f"priority_class {priority_class!r} is not allowed for this API key; allowed: {list(identity.priority_classes)}",
                param="priority_class",
                code="priority_class_forbidden",
            )
        return Decision(identity.tenant, priority_class)

    def _from_gateway(self, claims: Claims, default_class: str) -> Decision:
        tenant = _clean(claims.gateway_tenant)
        if tenant is None:
            raise AuthError(
                401,
                f"{GATEWAY_TENANT_HEADER} is required (--auth-mode trustedGateway): requests must come through the gateway",
                param=GATEWAY_TENANT_HEADER,
                code="missing_gateway_identity",
            )
        _check_tenant(tenant, GATEWAY_TENANT_HEADER)
        _refuse_conflicting_tenant(tenant, claims, GATEWAY_TENANT_HEADER)
        gateway_class = _clean(claims.gateway_class)
        if gateway_class is None:  # the gateway leaves the class to the client
            return Decision(tenant, claims.priority_class or default_class)
        if claims.priority_class is not None and claims.priority_class != gateway_class:
            raise AuthError(
                403,
                f"priority_class {claims.priority_class!r} conflicts with {GATEWAY_CLASS_HEADER} {gateway_class!r}",
                param="priority_class",
                code="priority_class_mismatch",
            )
        return Decision(tenant, gateway_class, class_param=GATEWAY_CLASS_HEADER)

