"""The optional API key: one shared secret that guards the data, not the probes.

When the embedding process passes a key to `create_app` (the CLI takes it from
FLARE_API_KEY), every route under `/v1` needs it, because `require_api_key` is a dependency
of the `/v1` router itself: a route added to that router later is guarded with no extra
work. Pages that show the same data (the incident page at /incidents/{id}) take the same
dependency, so they are guarded too whenever a key is set. Without a key nothing changes, as
for a laptop or a cluster network that is already private.

Left open on purpose, key or not:
- /livez, /healthz, /readyz: the orchestrator's probes and the compose health checks carry
  no credentials, and they answer only up/down and a reason;
- /metrics and the worker's /worker/stats: Prometheus scrapes without credentials, and they
  hold counters (requests, lag, dead letters by cause, job counts), never a job's data;
- /openapi.json and /docs: the shape of the API is not a secret, a client needs it before it
  has a key, and the schema documents the key itself (both schemes below).

A client sends the key as `X-API-Key: <key>` or `Authorization: Bearer <key>`. It is
compared with `hmac.compare_digest`, so the time taken does not tell how much of a guess was
right. A missing or wrong key is a 401 problem+json with `WWW-Authenticate`; the answer is
the same for both but for its detail, which names what was missing, never the key.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import HTTPException, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr
from starlette.datastructures import State

HEADER = "X-API-Key"
# RFC 9110 §11.6.1: a 401 names a scheme the client can answer with; Bearer is the standard
# one of the two we take.
CHALLENGE = 'Bearer realm="flare"'
MISSING = f"this API needs a key: send it in the {HEADER} header or as Authorization: Bearer <key>"

_key_header = APIKeyHeader(
    name=HEADER, auto_error=False, scheme_name="ApiKey",
    description="The key the server was started with (FLARE_API_KEY); needed only when one "
    "is set.",
)
_bearer = HTTPBearer(
    auto_error=False, scheme_name="Bearer",
    description="The same key as `Authorization: Bearer <key>`.",
)


def set_api_key(state: State, api_key: str | SecretStr | None) -> None:
    """Keep the key on the app's state (as a SecretStr: never in a repr or a log); an empty
    key is no key, as an unset variable in docker-compose gives an empty one."""
    secret = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
    state.api_key = SecretStr(secret) if secret else None


def _refuse(detail: str) -> HTTPException:
    return HTTPException(status_code=401, detail=detail,
                         headers={"WWW-Authenticate": CHALLENGE})


def require_api_key(
    request: Request,
    key: Annotated[str | None, Security(_key_header)] = None,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)] = None,
) -> None:
    """Refuse the request (401) unless it carries the app's key; pass when there is none.

    X-API-Key wins when both are sent. The header's raw bytes (Starlette decodes them as
    Latin-1, which round-trips) are compared with the key's UTF-8 bytes, so a non-ASCII key
    sent as UTF-8 works, and every comparison takes constant time."""
    expected: SecretStr | None = getattr(request.app.state, "api_key", None)
    if expected is None:
        return
    given = key if key is not None else (bearer.credentials if bearer is not None else None)
    if not given:
        raise _refuse(MISSING)
    if not hmac.compare_digest(given.encode("latin-1"), expected.get_secret_value().encode()):
        raise _refuse("wrong API key")
