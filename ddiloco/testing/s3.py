"""moto's S3 server on a loopback port, for tests, benchmarks and the chaos suite (moto is in the ``test`` extra)."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

try:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import BaseWSGIServer, make_server
except ImportError as err:  # pragma: no cover - depends on the install
    raise ImportError(
        "ddiloco.testing.s3 needs moto's S3 server, which is a test dependency: pip install 'ddiloco[test]'"
    ) from err

from ddiloco.testing.net import free_port, poll_until, port_open

TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Dispatcher(DomainDispatcherApplication):
    """moto's request dispatcher with S3 as its one service. moto's own works out each request's service anew, and on
    the way lists its ~150 service packages on disk: a fifth of the server's CPU under the chaos suite's traffic."""

    def get_application(self, environ: dict[str, Any]) -> Any:
        if environ.get("PATH_INFO", "").startswith("/moto-api"):
            return super().get_application(environ)
        with self.lock:
            app = self.app_instances.get("s3")
            if app is None:
                app = self.app_instances["s3"] = self.create_app("s3")
        return app


def s3_only_server(host: str, port: int) -> BaseWSGIServer:
    """A threaded moto S3 server bound to ``host:port`` (as moto's own server, with :class:`S3Dispatcher`)."""
    return make_server(host, port, S3Dispatcher(create_backend_app), threaded=True, request_handler=MotoRequestHandler)


class S3Server:
    """moto's S3 server on 127.0.0.1, restartable on the same port.

    In this process by default (its buckets outlive a stop/start: moto keeps them in this process's
    memory); ``own_process`` runs it as a child process instead, so clients in other network
    namespaces or a busy driver do not share its interpreter (its buckets then die with it)."""

    def __init__(self, port: int | None = None, *, own_process: bool = False, log: Path | None = None) -> None:
        self.port = port or free_port()
        self.own_process = own_process
        self.log = log
        self._server: BaseWSGIServer | subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        logging.getLogger("werkzeug").setLevel(logging.ERROR)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        if self.own_process:
            out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 - the child writes to it
            self._server = subprocess.Popen([sys.executable, "-m", "ddiloco.testing.s3", "--port", str(self.port)],
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if not poll_until(lambda: port_open("127.0.0.1", self.port), 60, interval_s=0.2):
                self.stop()
                raise RuntimeError(f"moto's S3 server did not start on port {self.port}")
        else:
            self._server = s3_only_server("127.0.0.1", self.port)
            self._thread = threading.Thread(target=self._server.serve_forever, name="moto-s3", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if isinstance(server, subprocess.Popen):
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)
        elif server is not None:
            server.shutdown()
            server.server_close()  # the port is free at once for a restart on it
            if self._thread is not None:
                self._thread.join()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self, secret: str = "testing") -> dict[str, str]:
        """The AWS_* variables that point plain s3fs / boto clients (and child processes) at this server."""
        return {**TEST_CREDENTIALS, "AWS_SECRET_ACCESS_KEY": secret, "AWS_ENDPOINT_URL": self.url}

    def storage_options(self, secret: str = "testing") -> dict:
        """s3fs options that reach this server without touching the environment."""
        return {"key": TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"], "secret": secret, "skip_instance_cache": True,
                "client_kwargs": {"endpoint_url": self.url}}

    def bucket(self, prefix: str = "b", storage_options: dict | None = None) -> str:
        """Create a new, empty bucket; its name."""
        import s3fs

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(**(storage_options if storage_options is not None else {"skip_instance_cache": True})).mkdir(name)
        return name


if __name__ == "__main__":  # S3Server(own_process=True)'s child
    parser = argparse.ArgumentParser(description="moto's S3 server, S3 only, on 127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    s3_only_server("127.0.0.1", parser.parse_args().port).serve_forever()
