"""Ports and waits: a free loopback port, polling a condition with a deadline, a local webhook that records what is posted to it,
and a loopback echo server."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def poll_until(
    predicate: Callable[[], T], timeout_s: float, *, interval_s: float = 0.1, transient: tuple[type[BaseException], ...] = ()
) -> T | None:
    """The first truthy value of ``predicate()``, or None once ``timeout_s`` has passed.

    An exception of a ``transient`` type counts as "not yet" (a backend restarting while we look)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except transient:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval_s)


def wait_for(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.1,
    transient: tuple[type[BaseException], ...] = (),
) -> T:
    """Like :func:`poll_until`, but a timeout is an error that says what never happened."""
    value = poll_until(predicate, timeout_s, interval_s=interval_s, transient=transient)
    if not value:
        raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
    return value


class Webhook:
    """A local HTTP endpoint that records the JSON bodies posted to it (e.g. by a notification block)."""

    def __init__(self) -> None:
        received: list[dict] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def posts(self, **contains: str) -> list[dict]:
        """The bodies so far whose every named field contains the given text."""
        return [body for body in list(self.received) if all(text in str(body.get(k, "")) for k, text in contains.items())]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class EchoServer:
    """A loopback TCP server that sends back whatever a connection sends it, one connection after another."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port: int = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    def __enter__(self) -> EchoServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
