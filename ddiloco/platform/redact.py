"""Credentials never leave the process: URLs are masked before they are recorded or shown."""

from __future__ import annotations

import re
from typing import Any

# scheme://user:password@host -> scheme://user:***@host (any scheme: SQLAlchemy, s3, gs, http ...)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^/@:\s]*):(?P<secret>[^/@\s]+)@")
MASK = "***"


def mask_url_credentials(text: str) -> str:
    """Replace the password of every ``scheme://user:password@`` in ``text`` with ***."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)


def mask_tree(value: Any) -> Any:
    """``mask_url_credentials`` applied to every string of a JSON-like tree."""
    if isinstance(value, str):
        return mask_url_credentials(value)
    if isinstance(value, dict):
        return {k: mask_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_tree(v) for v in value]
    return value
