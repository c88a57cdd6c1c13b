"""Credentials never leave the process: URLs are masked before they are recorded, logged or shown.

One rule for every shape a credential takes in a URL or a connection string (ledger, store bucket,
region), erring on the side of masking:

- the password of the userinfo, up to the *last* ``@`` that a host follows, so a password written with
  an unencoded ``@``, ``/`` or ``?`` is hidden whole (SQLAlchemy's ``make_url`` splits such a URL at the
  first ``@`` and would show the rest as host and database);
- the value of every query parameter whose name ends with a sensitive word (``password``, ``secret``,
  ``token``, ``sig``, ``key``, ``credential``, …: libpq's ``?password=``, ``s3://…?secret=``,
  ``gs://…?token=``, pre-signed ``X-Amz-Signature``), and of any parameter whose value carries such a
  ``name=value`` pair inside (libpq ``options``);
- ``name=value`` pairs of a libpq keyword/value conninfo string (``host=db password=…``).

Text without any of these is returned exactly as written."""

from __future__ import annotations

import logging
import re
import traceback
from typing import Any
from urllib.parse import unquote

MASK = "***"
SENSITIVE_WORDS = ("password", "passwd", "pwd", "secret", "token", "sig", "signature", "key", "credential", "credentials", "auth")
"""A parameter or keyword whose name ends with one of these (case, ``-`` and ``_`` ignored) is a secret:
``sslpassword``, ``aws_secret_access_key``, ``X-Amz-Security-Token`` are; ``tokenizer`` and ``key_id`` are not."""

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]*")
_CONNINFO_PAIR = re.compile(r"([A-Za-z][\w.\-]*)(\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&;]+)")


def is_sensitive(name: str) -> bool:
    """Whether a parameter called ``name`` carries a secret."""
    flat = name.lower().replace("-", "").replace("_", "")
    return flat.endswith(SENSITIVE_WORDS)


def _mask_pairs(text: str) -> str:
    """``name=value`` pairs (conninfo, libpq options) with the values of sensitive names masked."""
    return _CONNINFO_PAIR.sub(lambda m: m.group(1) + m.group(2) + MASK if is_sensitive(m.group(1)) else m.group(0), text)


def _mask_query(query: str) -> str:
    parts = []
    for part in re.split(r"([&;])", query):
        name, eq, value = part.partition("=")
        if eq and (is_sensitive(unquote(name)) or _mask_pairs(unquote(value)) != unquote(value)):
            part = f"{name}={MASK}"
        parts.append(part)
    return "".join(parts)


_HOST_AFTER_AT = re.compile(r"@(?=[\w.\-\[\]:%,]*(?:[/?#]|$))")


def _mask_one_url(url: str) -> str:
    scheme, _, rest = url.partition("://")
    # The userinfo ends at the last '@' followed by something shaped like a host (or hosts and ports):
    # a password may hold an unencoded '@', '/' or '?'.
    ats = [m.start() for m in _HOST_AFTER_AT.finditer(rest)]
    at = ats[-1] if ats else -1
    user, colon, _password = rest[: max(at, 0)].partition(":")
    if at > 0 and colon and not rest.startswith("/"):
        rest = f"{user}:{MASK}"
        remainder = url.partition("://")[2][at:]
    else:
        rest, remainder = "", rest
    path, q, query = remainder.partition("?")
    return f"{scheme}://{rest}{path}{q}{_mask_query(query)}"


_BARE_USERINFO = re.compile(r"(?<![\w.+\-/:@])([A-Za-z0-9._\-]+):(?!//)([^\s'\"<>`]+)@(?=[A-Za-z0-9\[])")
"""``user:password@host`` without its scheme, as an error quotes what it took for a host or a bucket name."""


def redact_url(text: str) -> str:
    """``text`` with every credential of the URLs (or the conninfo) in it masked; unchanged when it holds none."""
    if "://" in text:
        text = _URL.sub(lambda m: _mask_one_url(m.group(0)), text)
    elif "=" in text:
        text = _mask_pairs(text)
    return _BARE_USERINFO.sub(lambda m: f"{m.group(1)}:{MASK}@", text) if "@" in text else text


def one_line(err: BaseException, limit: int = 200) -> str:
    """An error as one line of at most ``limit`` characters, credentials masked (its type's name when it says nothing);
    a SQLAlchemy error as its driver's error, without the "Background on this error" link."""
    err = getattr(err, "orig", None) or err
    return redact_url(" ".join(str(err).split())[:limit]) or type(err).__name__


def mask_tree(value: Any) -> Any:
    """``redact_url`` applied to every string of a JSON-like tree; string values under sensitive keys masked whole."""
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        # Credentials passed as options ({"secret": ...}) rather than inside a URL.
        return {k: MASK if isinstance(v, str) and v and is_sensitive(str(k)) else mask_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_tree(v) for v in value]
    return value


class RedactingFilter(logging.Filter):
    """A handler filter that masks credentials in every record's message and traceback before it is written."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact_url(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_url("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        return True
