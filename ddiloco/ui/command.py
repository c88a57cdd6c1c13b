"""``ddiloco ui``: serve the operations dashboard for a ledger with ``streamlit run``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import typer

from ddiloco.ui import APP_PATH, LEDGER_URL_ENV

DEFAULT_PORT = 8501


def streamlit_command(port: int, address: str, headless: bool) -> list[str]:
    """The ``streamlit run`` invocation of the dashboard (the ledger URL travels in the environment,
    so a password in it never shows up in the process list)."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP_PATH),
        "--server.address",
        address,
        "--server.port",
        str(port),
        "--server.headless",
        "true" if headless else "false",
        "--client.toolbarMode",
        "viewer",
        "--browser.gatherUsageStats",
        "false",
    ]


def ui_command(
    ledger: str | None = typer.Option(
        None,
        "--ledger",
        envvar=LEDGER_URL_ENV,
        help="Ledger to show, read-only: sqlite:///path/ledger.db or postgresql+psycopg://user@host/db "
        f"(env {LEDGER_URL_ENV}). Default: the config default sqlite:///./ddiloco-runs/ledger.db.",
    ),
    port: int = typer.Option(DEFAULT_PORT, "--port", min=1, max=65535, help="Port to serve the dashboard on."),
    address: str = typer.Option("127.0.0.1", "--address", help="Interface to listen on (0.0.0.0 exposes it to the network)."),
    open_browser: bool = typer.Option(False, "--open-browser/--no-open-browser", help="Open a browser tab on start."),
) -> None:
    """Serve the operations dashboard: run health at a glance (learners, synchronizer, merges, events)."""
    from sqlalchemy.engine import make_url

    from ddiloco.platform.config import LedgerConfig
    from ddiloco.platform.redact import redact_url

    url = ledger or LedgerConfig().url.get_secret_value()
    try:
        make_url(url)
    except Exception:  # noqa: BLE001 - any parse failure is a bad URL
        typer.echo(f"error: not a ledger URL: {redact_url(url)}", err=True)
        raise typer.Exit(2) from None
    env = dict(os.environ, STREAMLIT_BROWSER_GATHER_USAGE_STATS="false")
    env[LEDGER_URL_ENV] = url
    typer.echo(f"dashboard for {redact_url(url)} on http://{address}:{port} (Ctrl-C stops it)")
    code = serve(streamlit_command(port, address, headless=not open_browser), env)
    if code:
        raise typer.Exit(code)


def serve(cmd: list[str], env: dict[str, str], stop_timeout_s: float = 10.0) -> int:
    """Run the Streamlit server until it exits; SIGTERM or Ctrl-C here stop it too (never orphaned)."""
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
