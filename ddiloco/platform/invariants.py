"""What must hold of a run's ledger and store at any moment, whatever failed (``ddiloco ledger check``).

- every submission has exactly one fate: merged into a version that exists, rejected with a reason,
  or pending;
- each fragment's versions are dense (0, 1, 2, …) and their fencing tokens never go backwards (no
  version from a synchronizer that had lost its lease);
- the newest version of each fragment points to a blob that exists and matches its sha256;
- every pending submission points to a blob that exists with the size its row records (the
  synchronizer hashes each one it merges; hashing every pending blob here would load the store the
  run depends on);
- tokens trained = merged + rejected + pending + lost + in flight;
- the running totals the per-step reads use equal what a full scan gives: each fragment's head is its
  newest version with the tokens and submissions merged into it, each learner's row counts its
  submissions, tokens and bytes (the check may scan; nothing per step does).

The checks are pure functions of plain rows; :func:`check_run` reads one snapshot of the ledger,
looks at the store and hands both to them. It only reads."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ddiloco.platform.ids import key_problem
from ddiloco.platform.ledger import rejections as rejections_q
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.models import MERGED, PENDING, REJECTED, FragmentHead, FragmentVersion, Learner, Run, Submission
from ddiloco.platform.runtime import RunContext
from ddiloco.platform.store import FragmentStore


@dataclass(frozen=True)
class Problem:
    """One broken invariant; ``lost`` counts the rows (or tokens) whose data is gone because of it."""

    what: str
    lost: int = 0

    def __str__(self) -> str:
        return self.what


@dataclass(frozen=True)
class VersionRow:
    fragment: int
    version: int
    lease_token: int
    blob_key: str
    sha256: str


@dataclass(frozen=True)
class SubmissionRow:
    id: int
    fragment: int
    status: str
    merged_version: int | None
    reject_reason: str | None
    blob_key: str
    nbytes: int
    region: str | None = None
    """The submitting learner's region, whose store holds the blob."""


@dataclass(frozen=True)
class Totals:
    """Running totals as stored, or the same figures from a full scan, keyed by fragment or learner."""

    heads: dict[int, tuple[int, str, str]]
    """fragment -> (version, blob key, sha256) of its head (scan: of its newest version)."""
    merged: dict[int, tuple[int, int]]
    """fragment -> (tokens merged, submissions merged)."""
    learners: dict[str, tuple[int, int, int]]
    """learner -> (submissions, tokens sent, bytes sent)."""
    rejected: tuple[int, int] = (0, 0)
    """(tokens, submissions) rejected in the whole run."""
    rejected_by: dict[tuple[str, str], tuple[int, int, int]] = field(default_factory=dict)
    """(learner id, reason class) -> (submissions, tokens, bytes) rejected."""


@dataclass(frozen=True)
class MovedOn:
    """What changed between reading a snapshot and listing the store: pending submissions decided since
    (whose blobs garbage collection may then delete) and fragments with a newer version since (whose
    old newest blob it may let go). A blob gone for one of these is not lost."""

    decided: frozenset[int] = frozenset()
    superseded: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Snapshot:
    versions: list[VersionRow]
    submissions: list[SubmissionRow]
    accounting: reports_q.TokenAccounting
    stored: Totals | None = None
    scanned: Totals | None = None


# --- the pure checks --------------------------------------------------------------------------------


def newest_versions(versions: Iterable[VersionRow]) -> dict[int, VersionRow]:
    out: dict[int, VersionRow] = {}
    for v in versions:
        if v.fragment not in out or v.version > out[v.fragment].version:
            out[v.fragment] = v
    return out


def version_problems(versions: Iterable[VersionRow]) -> list[Problem]:
    """Versions dense per fragment; fencing tokens non-decreasing with the version."""
    by_fragment: dict[int, list[VersionRow]] = defaultdict(list)
    for v in versions:
        by_fragment[v.fragment].append(v)
    problems = []
    for fragment, rows in sorted(by_fragment.items()):
        rows.sort(key=lambda v: v.version)
        numbers = [v.version for v in rows]
        if numbers != list(range(len(numbers))):
            missing = sorted(set(range(max(numbers) + 1)) - set(numbers))
            problems.append(Problem(f"fragment {fragment}: versions not dense (missing {missing[:10]}, "
                                    f"{len(numbers) - len(set(numbers))} duplicated)"))
        for before, after in zip(rows, rows[1:]):
            if after.lease_token < before.lease_token:
                problems.append(Problem(f"fragment {fragment}: v{after.version} has fencing token {after.lease_token} < "
                                        f"{before.lease_token} of v{before.version}: published by a synchronizer that had lost its lease"))
    return problems


def fate_problems(submissions: Iterable[SubmissionRow], newest: Mapping[int, int]) -> list[Problem]:
    """Each submission merged into an existing version, rejected with a reason, or pending — one of them."""
    problems = []
    for s in submissions:
        if s.status == MERGED:
            if s.merged_version is None or s.merged_version > newest.get(s.fragment, -1):
                problems.append(Problem(f"submission {s.id}: merged into v{s.merged_version} of fragment {s.fragment}, "
                                        "which does not exist"))
            elif s.reject_reason:
                problems.append(Problem(f"submission {s.id}: merged, and also a reject reason"))
        elif s.status == REJECTED:
            if not s.reject_reason:
                problems.append(Problem(f"submission {s.id}: rejected without a reason"))
            elif s.merged_version is not None:
                problems.append(Problem(f"submission {s.id}: rejected, and also merged into v{s.merged_version}"))
        elif s.status == PENDING:
            if s.merged_version is not None or s.reject_reason:
                problems.append(Problem(f"submission {s.id}: pending, yet with a merged version or a reject reason"))
        else:
            problems.append(Problem(f"submission {s.id}: no fate (status {s.status!r})"))
    return problems


def blob_problems(
    newest: Mapping[int, VersionRow],
    intact: Mapping[int, bool],
    pending: Iterable[SubmissionRow],
    listed_size: Mapping[int, int | None],
    moved_on: MovedOn = MovedOn(),
) -> list[Problem]:
    """The newest blob of each fragment verified (``intact`` by fragment); each pending blob listed with
    its recorded size (``listed_size`` by submission id, None when absent)."""
    problems = []
    for fragment, v in sorted(newest.items()):
        if not intact.get(fragment, False) and fragment not in moved_on.superseded:
            problems.append(Problem(f"fragment {fragment}: v{v.version}'s blob {v.blob_key} is missing or does not match "
                                    "its sha256", lost=1))
    for s in pending:
        size = listed_size.get(s.id)
        if size != s.nbytes and not (size is None and s.id in moved_on.decided):
            found = "is missing" if size is None else f"has {size} bytes, not {s.nbytes}"
            problems.append(Problem(f"pending submission {s.id}: its blob {s.blob_key} {found}", lost=1))
    return problems


def accounting_problems(acct: reports_q.TokenAccounting) -> list[Problem]:
    accounted = acct.merged + acct.rejected + acct.pending + acct.lost + acct.in_flight
    if acct.trained == accounted:
        return []
    return [Problem(f"token accounting does not balance: trained {acct.trained} != merged {acct.merged} + rejected "
                    f"{acct.rejected} + pending {acct.pending} + lost {acct.lost} + in flight {acct.in_flight}",
                    lost=abs(acct.trained - accounted))]


def totals_problems(stored: Totals, scanned: Totals) -> list[Problem]:
    """Every running total equals the full scan's figure (heads, merged totals, learner totals)."""
    problems = []
    for fragment in sorted(set(stored.heads) | set(scanned.heads)):
        have, want = stored.heads.get(fragment), scanned.heads.get(fragment)
        if have != want:
            problems.append(Problem(f"fragment {fragment}: head {_head(have)} but the newest version is {_head(want)}"))
    for fragment in sorted(set(stored.merged) | set(scanned.merged)):
        have, want = stored.merged.get(fragment, (0, 0)), scanned.merged.get(fragment, (0, 0))
        if have != want:
            problems.append(Problem(f"fragment {fragment}: running totals say {have[0]} tokens in {have[1]} merged submissions, "
                                    f"the submissions say {want[0]} in {want[1]}", lost=abs(have[0] - want[0])))
    for learner in sorted(set(stored.learners) | set(scanned.learners)):
        have, want = stored.learners.get(learner, (0, 0, 0)), scanned.learners.get(learner, (0, 0, 0))
        if have != want:
            problems.append(Problem(f"learner {learner}: row counts {have[0]} submissions, {have[1]} tokens, {have[2]} bytes; "
                                    f"the submissions say {want[0]}, {want[1]}, {want[2]}"))
    if stored.rejected != scanned.rejected:
        problems.append(Problem(f"run totals say {stored.rejected[0]} tokens in {stored.rejected[1]} rejected submissions, "
                                f"the submissions say {scanned.rejected[0]} in {scanned.rejected[1]}",
                                lost=abs(stored.rejected[0] - scanned.rejected[0])))
    for key in sorted(set(stored.rejected_by) | set(scanned.rejected_by)):
        have, want = stored.rejected_by.get(key, (0, 0, 0)), scanned.rejected_by.get(key, (0, 0, 0))
        if have != want:
            problems.append(Problem(f"learner {key[0]}, rejected as {key[1]!r}: totals say {have[0]} submissions, {have[1]} "
                                    f"tokens, {have[2]} bytes; the submissions say {want[0]}, {want[1]}, {want[2]}"))
    return problems


def _head(head: tuple[int, str, str] | None) -> str:
    return "none" if head is None else f"v{head[0]} ({head[1]})"


def check_snapshot(
    snap: Snapshot, intact: Mapping[int, bool], listed_size: Mapping[int, int | None], moved_on: MovedOn = MovedOn()
) -> list[Problem]:
    """Every invariant over one snapshot and what the store showed of it."""
    newest = newest_versions(snap.versions)
    pending = [s for s in snap.submissions if s.status == PENDING]
    return [
        *version_problems(snap.versions),
        *fate_problems(snap.submissions, {f: v.version for f, v in newest.items()}),
        *blob_problems(newest, intact, pending, listed_size, moved_on),
        *accounting_problems(snap.accounting),
        *(totals_problems(snap.stored, snap.scanned) if snap.stored is not None and snap.scanned is not None else []),
    ]


# --- reading the ledger and the store ---------------------------------------------------------------


def read_snapshot(session: Session, run_id: str) -> Snapshot:
    """The rows the checks need, from one transaction (raises UnknownRunError for a run not in the ledger)."""
    runs_q.require_run(session, run_id)
    versions = [
        VersionRow(*row)
        for row in session.execute(
            select(FragmentVersion.fragment, FragmentVersion.version, FragmentVersion.lease_token, FragmentVersion.blob_key,
                   FragmentVersion.sha256).where(FragmentVersion.run_id == run_id)
        )
    ]
    submissions = [
        SubmissionRow(*row)
        for row in session.execute(
            select(Submission.id, Submission.fragment, Submission.status, Submission.merged_version, Submission.reject_reason,
                   Submission.blob_key, Submission.nbytes, Learner.region)
            .outerjoin(Learner, (Learner.run_id == Submission.run_id) & (Learner.id == Submission.learner_id))
            .where(Submission.run_id == run_id)
        )
    ]
    return Snapshot(versions, submissions, reports_q.token_accounting(session, run_id), stored_totals(session, run_id),
                    scanned_totals(session, run_id, versions))


def stored_totals(session: Session, run_id: str) -> Totals:
    heads = session.execute(
        select(FragmentHead.fragment, FragmentHead.version, FragmentHead.blob_key, FragmentHead.sha256,
               FragmentHead.tokens_merged, FragmentHead.submissions_merged).where(FragmentHead.run_id == run_id)
    ).all()
    rows = session.execute(
        select(Learner.id, Learner.submissions, Learner.tokens_sent, Learner.bytes_sent).where(Learner.run_id == run_id)
    ).all()
    rejected = session.execute(select(Run.tokens_rejected, Run.submissions_rejected).where(Run.id == run_id)).one()
    return Totals(
        heads={f: (v, k, sha) for f, v, k, sha, _, _ in heads},
        merged={f: (int(t), int(n)) for f, _, _, _, t, n in heads if t or n},
        learners={lid: (int(n), int(t), int(b)) for lid, n, t, b in rows},
        rejected=(int(rejected[0]), int(rejected[1])),
        rejected_by={(t.learner_id, t.reason): (t.submissions, t.tokens, t.nbytes) for t in reports_q.rejected_totals(session, run_id)},
    )


def scanned_totals(session: Session, run_id: str, versions: list[VersionRow]) -> Totals:
    """The same figures from every row (the scan ``ledger check`` may afford and a step may not)."""
    merged = session.execute(
        select(Submission.fragment, func.coalesce(func.sum(Submission.tokens_new), 0), func.count())
        .where(Submission.run_id == run_id, Submission.status == MERGED).group_by(Submission.fragment)
    ).all()
    sent = dict.fromkeys(session.scalars(select(Learner.id).where(Learner.run_id == run_id)), (0, 0, 0))
    sent.update({
        lid: (int(n), int(t), int(b))
        for lid, n, t, b in session.execute(
            select(Submission.learner_id, func.count(), func.coalesce(func.sum(Submission.tokens_new), 0),
                   func.coalesce(func.sum(Submission.nbytes), 0))
            .where(Submission.run_id == run_id, Submission.learner_id.in_(list(sent))).group_by(Submission.learner_id)
        )
    })
    rejected = session.execute(
        select(func.coalesce(func.sum(Submission.tokens_new), 0), func.count())
        .where(Submission.run_id == run_id, Submission.status == REJECTED)
    ).one()
    rejected_by: dict[tuple[str, str], tuple[int, int, int]] = {}
    for lid, reason, n, t, b in session.execute(
        select(Submission.learner_id, Submission.reject_reason, func.count(), func.coalesce(func.sum(Submission.tokens_new), 0),
               func.coalesce(func.sum(Submission.nbytes), 0))
        .where(Submission.run_id == run_id, Submission.status == REJECTED)
        .group_by(Submission.learner_id, Submission.reject_reason)
    ):
        key = (lid, rejections_q.reason_class(reason))
        was = rejected_by.get(key, (0, 0, 0))
        rejected_by[key] = (was[0] + int(n), was[1] + int(t), was[2] + int(b))
    return Totals(
        heads={f: (v.version, v.blob_key, v.sha256) for f, v in newest_versions(versions).items()},
        merged={f: (int(t), int(n)) for f, t, n in merged},
        learners=sent,
        rejected=(int(rejected[0]), int(rejected[1])),
        rejected_by=rejected_by,
    )


def _bare(path: str) -> str:
    """A store path without its protocol or leading slash, as listings and ``store.path`` may differ in both."""
    return path.split("://", 1)[-1].lstrip("/")


def listed_sizes(store: FragmentStore, prefix: str) -> dict[str, int]:
    """Size of every blob under ``prefix``, by bare path, from one listing."""
    try:
        found = store.fs.find(store.path(prefix), detail=True)
    except FileNotFoundError:
        return {}
    return {_bare(path): int(info["size"]) for path, info in found.items()}


def probe_store(
    snap: Snapshot, run_id: str, store_for: Callable[[str | None], FragmentStore]
) -> tuple[dict[int, bool], dict[int, int | None]]:
    """(newest version blob verified, by fragment; pending blob's listed size, by submission id)."""
    central = store_for(None)
    intact = {f: central.verify(v.blob_key, v.sha256) for f, v in newest_versions(snap.versions).items()}
    by_region: dict[str | None, list[SubmissionRow]] = defaultdict(list)
    for s in snap.submissions:
        if s.status == PENDING:
            by_region[s.region].append(s)
    listings: dict[str, dict[str, int]] = {}
    sizes: dict[int, int | None] = {}
    for region, rows in by_region.items():
        store = store_for(region)
        # One listing per store instead of a request per blob; taken after the rows were read, and a
        # blob is written before its row, so a blob that exists is listed.
        if store.url not in listings:
            listings[store.url] = listed_sizes(store, f"{run_id}/submissions")
        # A key no blob may have (a row written around the learner's functions) names nothing: missing.
        sizes.update({s.id: None if key_problem(s.blob_key) else listings[store.url].get(_bare(store.path(s.blob_key)))
                      for s in rows})
    return intact, sizes


def check_run(ctx: RunContext, store_for: Callable[[str | None], FragmentStore] | None = None) -> list[Problem]:
    """Every broken invariant of ``ctx``'s run; an empty list when the run is sound."""
    with ctx.reading() as s:
        snap = read_snapshot(s, ctx.run_id)
    intact, sizes = probe_store(snap, ctx.run_id, store_for or ctx.store)
    missing = [i for i, size in sizes.items() if size is None]
    newest = newest_versions(snap.versions)
    failed = {f: newest[f].version for f, ok in intact.items() if not ok}
    if not missing and not failed:
        return check_snapshot(snap, intact, sizes)
    # The store is looked at after the rows were read, and the synchronizer goes on meanwhile: a blob
    # gone for a row that has moved on since may have been collected. Rows only move forward (pending
    # to decided, a fragment to a newer version), so one still as it was had its blob all along.
    with ctx.reading() as s:
        moved_on = read_moved_on(s, ctx.run_id, missing, failed)
    return check_snapshot(snap, intact, sizes, moved_on)


def read_moved_on(session: Session, run_id: str, submission_ids: list[int], newest: Mapping[int, int]) -> MovedOn:
    """Which of ``submission_ids`` are no longer pending, and which fragments have a version newer than ``newest``'s."""
    decided = set()
    for start in range(0, len(submission_ids), 500):
        decided.update(session.scalars(
            select(Submission.id).where(Submission.run_id == run_id, Submission.id.in_(submission_ids[start:start + 500]),
                                        Submission.status != PENDING)
        ))
    superseded = {
        f for f, top in session.execute(
            select(FragmentVersion.fragment, func.max(FragmentVersion.version))
            .where(FragmentVersion.run_id == run_id, FragmentVersion.fragment.in_(list(newest))).group_by(FragmentVersion.fragment)
        ) if top > newest[f]
    }
    return MovedOn(frozenset(decided), frozenset(superseded))
