"""How long a connection to the ledger or to an object store may stall before it is dropped and retried on a new one.

A network cut stalls an open TCP connection in retransmission, and TCP backs off exponentially: left alone, the
connection goes on only at its next retransmission, which after a cut of a minute can come a minute after the heal.
With ``TCP_USER_TIMEOUT`` the kernel ends a connection whose sent bytes stay unacknowledged this long, so the client's
own retry opens a new connection, which fails within the bound while the cut lasts and succeeds once it heals. The bound
counts only time without acknowledgement: a slow link, a long query or a large upload that is making progress is
never cut short. A ledger URL's own libpq parameters and a store's own ``config_kwargs`` take precedence."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

STALL_TIMEOUT_S = 10.0
"""Seconds without an acknowledgement (or without an answer to a new connection) before a connection is dropped."""

_S3_PROTOCOLS = ("s3://", "s3a://")


def libpq_params(query: Mapping[str, Any]) -> dict[str, int]:
    """libpq connection parameters bounding stalls (those the URL's ``query`` does not set itself)."""
    seconds = round(STALL_TIMEOUT_S)  # libpq counts these in whole seconds
    params = {
        "connect_timeout": seconds,
        "tcp_user_timeout": int(STALL_TIMEOUT_S * 1000),
        # Keepalive probes find a pooled connection that went dead while idle; TCP_USER_TIMEOUT then bounds them too.
        "keepalives": 1,
        "keepalives_idle": seconds,
        "keepalives_interval": max(1, seconds // 3),
        "keepalives_count": 3,
    }
    return {k: v for k, v in params.items() if k not in query}


def _bounded_socket(addr_info: tuple) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    if family in (socket.AF_INET, socket.AF_INET6) and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(STALL_TIMEOUT_S * 1000))
    return sock


def store_options(url: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """fsspec ``options`` for the store at ``url``, with stalls bounded where the filesystem allows it: s3fs's sockets
    get ``TCP_USER_TIMEOUT`` (its own connect and read timeouts do not cover a request stalled while it is sent)."""
    out = dict(options or {})
    if not url.startswith(_S3_PROTOCOLS):
        return out
    config = dict(out.get("config_kwargs") or {})
    connector = dict(config.get("connector_args") or {})
    connector.setdefault("socket_factory", _bounded_socket)
    config["connector_args"] = connector
    out["config_kwargs"] = config
    return out
