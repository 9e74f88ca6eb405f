"""URLs as safe to print: what a log line, an error message or a repr may show of a URL that
can carry a secret.

Flare's settings hold URLs that can carry credentials: ClickHouse
(`http://user:password@host/db`), Alertmanager behind basic auth
(`https://user:password@am/`) and webhooks whose user or path is itself the secret (chat
webhooks are `https://hooks.example/services/<token>`). Printing where we talk to helps an
operator; printing how we get in does not. So a password never shows, a query string never
shows (it can hold `?token=`), and for an `opaque` URL (a webhook, an alert receiver) neither
does its user nor its path.

>>> redact_url("http://flare:s3cret@clickhouse:8123/flare?password=x")
'http://flare@clickhouse:8123/flare'
>>> redact_url("https://tok3n@hooks.example/services/T0/B0/XXXX", opaque=True)
'https://hooks.example/…'
>>> redact_url("chdb:///./data/chdb"), redact_url("chdb://:memory:")
('chdb:///./data/chdb', 'chdb://:memory:')
"""

from __future__ import annotations

from urllib.parse import urlsplit


def redact_url(url: str, *, opaque: bool = False) -> str:
    """`url` without its password and query string; `opaque` also drops its user and path.
    Text that is no URL comes back as a placeholder, since it may be a secret pasted in the
    wrong place."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced [ in the host
        return "<unparsable URL>"
    if not parts.scheme or not (parts.netloc or parts.path.startswith("/")):
        return "<not a URL>"
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    where = f"{user}@{hostport}" if at and user and not opaque else hostport
    if opaque:
        return f"{parts.scheme}://{where}{'/…' if parts.path.strip('/') else ''}"
    return f"{parts.scheme}://{where}{parts.path}"
