"""What the ledger raises when one of its rules refuses a write: every role catches some of these."""

from __future__ import annotations


class LedgerError(RuntimeError):
    """A ledger rule refused a write."""


class LeaseLostError(LedgerError):
    """The writer does not hold the synchronizer lease (any more): its write is refused."""


class VersionConflictError(LedgerError):
    """The version to publish is not the next one: someone else published, or a gap would appear."""


class AlreadyDecidedError(LedgerError):
    """A submission to merge or reject already has a fate."""


class UnknownRunError(LedgerError):
    pass


class SubmissionConflictError(LedgerError):
    """A submission id registered again with other content: the first registration stands, the second is refused."""


class WorldSizeError(LedgerError):
    """A learner registering with more ranks than the run allows (``learners.max_world_size``)."""


class InvalidArgumentError(LedgerError, ValueError):
    """A count, limit or duration no caller of the ledger passes (negative, zero where one is needed, beyond its
    column, not finite): refused with its name before any statement runs."""
