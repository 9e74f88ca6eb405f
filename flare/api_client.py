"""The one way a CLI command talks to a running Flare API (`flare incidents`, and any
command that reads over HTTP): where the API is, and the key it may want.

Each such command takes `--api` (FLARE_API_URL) and otherwise asks
http://FLARE_API_HOST:FLARE_API_PORT, as the worker and `flare api` bind; when FLARE_API_KEY
is set, every request carries it in the X-API-Key header, so a command works the same
against an open API and a guarded one (api/auth.py). The key travels as sent: use https
between networks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flare.settings import Settings

if TYPE_CHECKING:
    import httpx

HEADER = "X-API-Key"  # api.auth.HEADER; not imported, to keep FastAPI out of the CLI's start


def api_url(settings: Settings, api: str | None = None) -> str:
    """The API's base URL: `api` when given, else the host and port the API binds."""
    return (api or f"http://{settings.api_host}:{settings.api_port}").rstrip("/")


def api_headers(settings: Settings) -> dict[str, str]:
    """The headers every request sends: the key, when one is set (an empty one is none)."""
    key = settings.api_key.get_secret_value() if settings.api_key is not None else ""
    return {HEADER: key} if key else {}


def api_client(settings: Settings, api: str | None = None, timeout_s: float = 10.0
               ) -> httpx.Client:
    """An httpx client on the API's base URL that sends the key; use it as a context."""
    import httpx

    return httpx.Client(base_url=api_url(settings, api), headers=api_headers(settings),
                        timeout=timeout_s)


def error_detail(response: httpx.Response) -> str:
    """What an error answer says, on one line (the `detail` of its problem+json), with what
    to do about a refused key."""
    try:
        body = response.json()
        detail = str(body.get("detail") or body.get("title")) if isinstance(body, dict) else ""
    except ValueError:
        detail = ""
    detail = " ".join((detail or response.text or response.reason_phrase).split())[:300]
    if response.status_code == 401:
        detail += " (set FLARE_API_KEY to the API's key)"
    return detail
