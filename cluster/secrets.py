"""API keys and their tenants, and the cluster secret: read from files (or the command line for
keys), compared in constant time, never printed (their reprs are redacted).

`--api-key-file FILE`: one key per line, `TENANT:KEY` to name the key's tenant, or the key alone
(its tenant is then its own, named `key-` and 8 hex digits of the key's SHA-256, safe to log).
Keys that share a tenant name are one tenant: they see each other's requests (Abort) and share the
prefix cache. Blank lines and lines starting with `#` are skipped.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16


@dataclass(frozen=True)
class ApiKey:
    tenant: str
    key: bytes = field(repr=False)

    def __repr__(self) -> str:
        return f"ApiKey(tenant={self.tenant!r}, key=<redacted>)"


@dataclass(frozen=True)
class Secret:
    """A shared secret whose value never reaches a log line or a repr."""
    value: bytes = field(repr=False)

    def __repr__(self) -> str:
        return "Secret(<redacted>)"


def bare_key_tenant(key: bytes) -> str:
    return "key-" + hashlib.sha256(key).hexdigest()[:8]


def parse_api_key(line: str) -> ApiKey:
    """`TENANT:KEY` or `KEY`."""
    text = line.strip()
    tenant, sep, key = text.partition(":")
    if not sep:
        tenant, key = "", text
    tenant, key = tenant.strip(), key.strip()
    if not key:
        raise ValueError("an API key line has no key (expected TENANT:KEY or KEY)")
    if sep and not tenant:
        raise ValueError("an API key line has an empty tenant name before ':'")
    if tenant and not (tenant.replace("-", "").replace("_", "").replace(".", "").isalnum() and len(tenant) <= 64):
        raise ValueError(f"tenant names are up to 64 letters, digits, '-', '_' or '.'; got {tenant!r}")
    raw = key.encode()
    return ApiKey(tenant or bare_key_tenant(raw), raw)


def _check_private(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s is readable by other users (mode %o); chmod 600 it", path, stat.S_IMODE(mode))


def read_api_key_file(path: str | os.PathLike) -> tuple[ApiKey, ...]:
    p = Path(path)
    _check_private(p)
    keys = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            keys.append(parse_api_key(line))
        except ValueError as exc:
            raise ValueError(f"{p}:{n}: {exc}") from None
    if not keys:
        raise ValueError(f"{p}: no API key in the file")
    return tuple(keys)


def read_secret_file(path: str | os.PathLike) -> Secret:
    p = Path(path)
    _check_private(p)
    value = p.read_bytes().strip()
    if len(value) < MIN_SECRET_BYTES:
        raise ValueError(f"{p}: a cluster secret needs at least {MIN_SECRET_BYTES} bytes "
                         "(e.g. `head -c 32 /dev/urandom | base64 > FILE`)")
    return Secret(value)


def as_api_keys(keys) -> tuple[ApiKey, ...]:
    """ApiKeys as given, and plain strings (`--api-key KEY`) as bare keys (the whole string is the key)."""
    return tuple(k if isinstance(k, ApiKey) else ApiKey(bare_key_tenant(k.encode()), k.encode()) for k in keys)


def authenticate(keys: tuple[ApiKey, ...], token: bytes) -> str | None:
    """The tenant of the key `token` is, or None. Every key is compared (constant time each), so
    the time taken says nothing of which key matched or how much of one did."""
    tenant = None
    for k in keys:
        if hmac.compare_digest(token, k.key) and tenant is None:
            tenant = k.tenant
    return tenant
