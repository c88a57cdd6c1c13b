"""Validation of the ids that become parts of object-store keys and ledger rows."""

from __future__ import annotations

import re

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class InvalidIdError(ValueError):
    """An id that could escape its key prefix or is otherwise unsafe."""


def validate_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is a safe id (letters, digits, ``_ . -``; no ``..``), else raise."""
    if not isinstance(value, str) or not _ID.fullmatch(value) or ".." in value:
        raise InvalidIdError(
            f"{what} {value!r} is not a valid id: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit, without '..'"
        )
    return value


_HOLDER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}$")


def validate_holder(value: str) -> str:
    """Return ``value`` if it is a safe synchronizer holder name (an id, or ``label@host:pid``), else raise."""
    if not isinstance(value, str) or not _HOLDER.fullmatch(value):
        raise InvalidIdError(
            f"synchronizer holder {value!r} is not valid: use 1-128 letters, digits, '_', '.', '-', '@' or ':', "
            "starting with a letter or digit"
        )
    return value


def global_key(run: str, fragment: int, version: int) -> str:
    return f"{validate_id(run, 'run')}/global/f{int(fragment)}/v{int(version)}.safetensors"


def outer_state_key(run: str, fragment: int, version: int) -> str:
    return f"{validate_id(run, 'run')}/outer/f{int(fragment)}/v{int(version)}.safetensors"


def submission_key(run: str, fragment: int, learner: str, uid: str) -> str:
    return (
        f"{validate_id(run, 'run')}/submissions/f{int(fragment)}/"
        f"{validate_id(learner, 'learner')}/{validate_id(uid, 'submission id')}.safetensors"
    )


def learner_state_key(run: str, learner: str, uid: str) -> str:
    """A learner's saved state: a directory of torch.distributed.checkpoint files (see learner_worker/state.py)."""
    return f"{validate_id(run, 'run')}/learners/{validate_id(learner, 'learner')}/{validate_id(uid, 'state id')}"
