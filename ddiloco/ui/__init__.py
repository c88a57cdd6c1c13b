"""The Streamlit operations dashboard: run health at a glance, read from the ledger (never written).

``ddiloco ui --ledger URL`` serves it; ``queries`` holds every SQL read and ``health`` every verdict,
both free of Streamlit so they are tested on their own."""

from __future__ import annotations

from pathlib import Path

LEDGER_URL_ENV = "DDILOCO_LEDGER_URL"
"""Environment variable naming the ledger the dashboard reads (``--ledger`` sets it)."""
APP_PATH = Path(__file__).resolve().parent / "app.py"

__all__ = ["APP_PATH", "LEDGER_URL_ENV"]
