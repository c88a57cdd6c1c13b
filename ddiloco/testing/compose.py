"""infra/compose.yaml as the tests read it: rendered with an .env file as ``docker compose`` does, and
its services' environments pointed at this machine's PostgreSQL, S3 and ports instead of the stack's
hostnames (this machine cannot run containers: no Docker daemon)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml
from sqlalchemy.engine import make_url

INFRA = Path(__file__).resolve().parents[2] / "infra"
COMPOSE = INFRA / "compose.yaml"


def dotenv(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of an .env file (comments and blank lines skipped)."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def render_compose(env_file: Path = INFRA / ".env.example") -> dict:
    """compose.yaml with ``${VAR}`` and ``${VAR:?message}`` filled from ``env_file``; a missing variable is a KeyError."""
    values = dotenv(env_file)
    text = re.sub(r"\$\{(\w+)(?::\?[^}]*)?\}", lambda m: values[m.group(1)], COMPOSE.read_text())
    return yaml.safe_load(text)


def service_command(compose: dict, service: str) -> list[str]:
    command = compose["services"][service]["command"]
    return list(command) if isinstance(command, list) else shlex.split(command)


def localize_url(url: str, server: str, databases: dict[str, str]) -> str:
    """A compose database URL on ``server`` (host, port, user of this machine's PostgreSQL), its database
    renamed through ``databases``; driver and password kept (the local server trusts; the password is ignored)."""
    compose_url, local = make_url(url), make_url(server)
    return compose_url.set(host=local.host, port=local.port, username=local.username,
                           database=databases[compose_url.database]).render_as_string(hide_password=False)
