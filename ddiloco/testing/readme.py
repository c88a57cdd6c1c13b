"""The README's commands as a user types them: tests run these very lines, so editing one in the README
changes what is tested, and a command the README gains without a test is noticed."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
ORCHESTRATION = "Orchestration with Prefect"
EXEC = ["docker", "compose", "-f", "infra/compose.yaml", "exec"]
"""How the README runs a command inside a compose service: ``docker compose -f infra/compose.yaml exec SERVICE …``."""

COMMAND_SPAN = re.compile(r"^(?:[A-Z][A-Z0-9_]*=\S+ )*(?:ddiloco|prefect|docker|cp) \S")
"""An inline code span that is a command line (``ddiloco demo``, ``DDILOCO_X=… ddiloco deploy …``), not a name."""

ASSIGNMENT = re.compile(r"^[A-Z][A-Z0-9_]*=")


@dataclass(frozen=True)
class Command:
    line: str
    """The command as the README writes it (continuation lines joined, its comment dropped)."""
    service: str | None
    """The compose service it runs in (``docker compose … exec SERVICE``); None: on the user's own machine."""
    argv: list[str]
    """What runs, without the ``docker compose … exec SERVICE`` prefix and the leading ``NAME=value`` assignments."""
    env: dict[str, str] = field(default_factory=dict)
    """The ``NAME=value`` assignments the line starts with: the command's environment beyond the caller's."""


def section(title: str = ORCHESTRATION, text: str | None = None) -> str:
    """The body of the README's ``## title`` section, up to the next ``## `` heading."""
    text = README.read_text() if text is None else text
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    if match is None:
        raise KeyError(f"README has no '## {title}' section")
    return match.group(1)


def parse(line: str) -> Command:
    argv = shlex.split(line, comments=True)
    if argv[: len(EXEC)] == EXEC:
        return Command(line, argv[len(EXEC)], argv[len(EXEC) + 1:])
    env = {}
    while argv and ASSIGNMENT.match(argv[0]):
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    return Command(line, None, argv, env)


def fenced_commands(title: str = ORCHESTRATION, text: str | None = None) -> list[Command]:
    """The commands of the section's ```bash blocks: backslash continuations joined, comment lines dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", section(title, text), flags=re.M | re.S):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(parse(line.strip()))
    return commands


def inline_commands(title: str = ORCHESTRATION, text: str | None = None) -> list[str]:
    """The section's inline code spans that are command lines, in order."""
    body = re.sub(r"^```.*?^```", "", section(title, text), flags=re.M | re.S)
    return [span for span in re.findall(r"`([^`\n]+)`", body) if COMMAND_SPAN.match(span)]


def readme_command(*prefix: str, title: str = ORCHESTRATION) -> Command:
    """The one fenced command of the section whose argv (inside its service) starts with ``prefix``."""
    found = [c for c in fenced_commands(title) if c.argv[: len(prefix)] == list(prefix)]
    if len(found) != 1:
        raise KeyError(f"README's '{title}' has {len(found)} commands starting with {' '.join(prefix)!r}, expected one")
    return found[0]
