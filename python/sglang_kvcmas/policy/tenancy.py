"""Tenants: requests sent under different credentials never share KV, nor a workflow.

A request's tenant is the credential it came with, the HTTP ``Authorization`` header as it
reached the server: what the client sent, or what the gateway in front of the servers passed
on after checking it (``server/cluster.py``: SMG with one API key per tenant forwards the
header unchanged and answers 401 to any other). The server needs no configuration and trusts no
header: a tenant's namespace is derived from its credential, so a request can only enter it by
presenting that credential.

- **KV.** The request's ``cache_salt`` (SGLang's and our tree cache's namespace) becomes
  ``kvcmas-tenant:<tenant>`` followed by ``/<cache_salt>`` when the body sets one: a client's
  own salt only partitions its tenant further and can never name another tenant's namespace.
  A body salt that starts with the reserved prefix is refused (400), so a request without a
  credential cannot forge a tenant's namespace either.
- **Workflows.** The workflow name becomes ``<tenant>/<name>``, so two tenants' workflows of
  the same name keep apart in the ledger, its budgets and metrics (the usage object reports the
  scoped name); a request without a credential may not name a workflow in that form.

``<tenant>`` is the first :data:`TENANT_CHARS` hex digits of the credential's SHA-256: it never
holds the credential itself. Requests without an ``Authorization`` header keep their salt and
workflow names as sent (one tenant: a single server that checks no key). Pure Python.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

AUTH_HEADER = "authorization"
TENANT_SALT_PREFIX = "kvcmas-tenant:"
"""Reserved start of a tenant-scoped ``cache_salt``; a client's salt may not use it."""
TENANT_CHARS = 16
"""Hex digits of the credential's SHA-256 naming its tenant (64 bits)."""
SCOPE_CHARS = TENANT_CHARS + 1
"""What scoping adds to a workflow's name (``<tenant>/``)."""


_SCOPED = re.compile(rf"[0-9a-f]{{{TENANT_CHARS}}}/")


class TenancyError(ValueError):
    """A request's ``cache_salt`` tries to name a tenant namespace itself."""


def tenant_of(headers: Mapping[str, Any] | None) -> str | None:
    """The tenant of a request with these HTTP headers (case-insensitive mapping, as
    Starlette's), or None when it carries no credential."""
    if headers is None:
        return None
    credential = headers.get(AUTH_HEADER)
    if not isinstance(credential, str) or not credential.strip():
        return None
    return hashlib.sha256(credential.strip().encode()).hexdigest()[:TENANT_CHARS]


def scoped_salt(tenant: str | None, salt: str | None) -> str | None:
    """The namespace salt of a request of ``tenant`` whose body set ``salt``.

    Raises:
        TenancyError: ``salt`` starts with :data:`TENANT_SALT_PREFIX`.
    """
    if salt and salt.startswith(TENANT_SALT_PREFIX):
        raise TenancyError(f"cache_salt may not start with {TENANT_SALT_PREFIX!r}: the server "
                           f"scopes salts by the request's credential")
    if tenant is None:
        return salt
    return f"{TENANT_SALT_PREFIX}{tenant}/{salt}" if salt else f"{TENANT_SALT_PREFIX}{tenant}"


def scoped_workflow(tenant: str | None, workflow: str | None) -> str | None:
    """The workflow name a request of ``tenant`` is accounted under.

    Raises:
        TenancyError: a request without a credential names a workflow in a tenant's form.
    """
    if workflow is None:
        return None
    if tenant is None:
        if _SCOPED.match(workflow):
            raise TenancyError(f"a workflow name may not start with {TENANT_CHARS} hex digits "
                               f"and '/' without a credential: that is a tenant's scope")
        return workflow
    return f"{tenant}/{workflow}"


def scope_request(obj: Any, tenant: str | None) -> None:
    """Set the tenant's salt on a ``GenerateReqInput`` (its ``cache_salt``: None, one string or
    one per prompt), in place.

    Raises:
        TenancyError: a body salt uses the reserved prefix.
    """
    if not hasattr(obj, "cache_salt"):
        return
    salt = obj.cache_salt
    if isinstance(salt, list):
        obj.cache_salt = [scoped_salt(tenant, s or None) for s in salt]
    elif salt is None or isinstance(salt, str):
        scoped = scoped_salt(tenant, salt or None)
        if scoped is not None or salt is not None:
            obj.cache_salt = scoped
