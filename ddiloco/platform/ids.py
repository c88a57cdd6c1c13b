"""The one rule for names that become parts of object-store keys and ledger rows: ids (:func:`validate_id`) and
the keys built from them or read back from the ledger (:func:`validate_key`)."""

from __future__ import annotations

import re

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

TMP_PREFIX = ".tmp-"
"""What the fragment store names its temporary files (a blob is written under it, then linked to its key)."""
RESERVED_PREFIXES = (TMP_PREFIX,)
"""Names the store keeps for itself: no key may name a file beginning so (a listing skips them, a crash leaves them)."""
MAX_KEY_CHARS = 1024
"""S3's limit on a key's length (in bytes; keys are ASCII here)."""

# Names Windows gives to devices in every directory, whatever their extension ("nul.txt" is the null device too).
_DEVICE = re.compile(r"^(con|prn|aux|nul|com[0-9]|lpt[0-9])(\..*)?$", re.IGNORECASE)
# Any character outside printable ASCII (control characters, NUL, DEL) or one that some OS or store reads as a
# separator or a stream (':' a Windows drive or alternate data stream, '\\' a Windows separator).
_UNSAFE_KEY_CHAR = re.compile(r"[^\x21-\x7e]|[\\:*?\"<>|]")


class InvalidIdError(ValueError):
    """An id that could escape its key prefix or is otherwise unsafe."""


def validate_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is a safe id (letters, digits, ``_ . -``; no ``..``, no trailing ``.``, not a Windows
    device name), else raise."""
    if not isinstance(value, str) or not _ID.fullmatch(value) or ".." in value or value.endswith("."):
        raise InvalidIdError(
            f"{what} {value!r} is not a valid id: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit and not ending in '.', without '..'"
        )
    if _DEVICE.fullmatch(value):
        raise InvalidIdError(f"{what} {value!r} is not a valid id: Windows names a device so")
    return value


def key_problem(key: object) -> str | None:
    """Why ``key`` may not name a blob below a store's root, or None.

    A key is '/'-separated names, each non-empty, not '.' or '..', of printable ASCII without a separator of
    another OS (``\\``, ``:``) or a character Windows refuses, not a device name, not beginning with a prefix the
    store reserves (:data:`RESERVED_PREFIXES`)."""
    if not isinstance(key, str) or not key:
        return "empty or not a string"
    if len(key) > MAX_KEY_CHARS:
        return f"longer than {MAX_KEY_CHARS} characters"
    bad = _UNSAFE_KEY_CHAR.search(key)
    if bad:
        return f"holds {bad.group()!r} (control characters, spaces, path separators other than '/' and ':*?\"<>|' are refused)"
    for part in key.split("/"):
        if part in ("", ".", ".."):
            return "has an empty, '.' or '..' part"
        if part.startswith(RESERVED_PREFIXES):
            return f"names {part[:40]!r}, under a prefix the store reserves for its temporary files"
        if _DEVICE.fullmatch(part) or part.endswith("."):
            return f"names {part[:40]!r}, which Windows reads as a device or another name"
    return None


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe store key (:func:`key_problem`), else raise."""
    why = key_problem(key)
    if why:
        raise InvalidIdError(f"unsafe store key {str(key)[:160]!r}: {why}")
    return key


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
