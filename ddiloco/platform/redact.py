"""Credentials never leave the process: URLs are masked before they are recorded or shown.

One rule for every URL (ledger, store, region buckets): SQLAlchemy's URL parser reads
``scheme://user:password@host/path?query`` for any scheme, and renders it with the password hidden."""

from __future__ import annotations

from typing import Any

MASK = "***"
SECRET_QUERY_KEYS = frozenset({"password"})
"""Query parameters that carry a password (libpq reads ``?password=``)."""


def redact_url(text: str) -> str:
    """``text`` with the password of its URL masked (in the userinfo or the query); unchanged when it holds none."""
    if "://" not in text:
        return text
    # Imported here: the CLI validates a config before it loads SQLAlchemy.
    from sqlalchemy.engine import make_url

    try:
        url = make_url(text)
    except Exception:  # noqa: BLE001 - unparseable: show nothing that might be a secret
        return MASK if "@" in text or "password" in text.lower() else text
    secret_keys = [k for k in url.query if k.lower() in SECRET_QUERY_KEYS]
    if url.password is None and not secret_keys:
        return text  # nothing to hide: the URL is kept exactly as written
    if secret_keys:
        url = url.update_query_dict({k: MASK for k in secret_keys})
    return url.render_as_string(hide_password=True)


def mask_tree(value: Any) -> Any:
    """``redact_url`` applied to every string of a JSON-like tree."""
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: mask_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_tree(v) for v in value]
    return value
