"""A learner's link to its run: rank 0's ledger and store I/O, off the training thread.

The link registers incarnations, uploads outer gradients and registers them, downloads newer
global versions into an inbox, saves and loads AdamW state, and heartbeats. In a process its
upload and poll threads do that in the background (:meth:`LearnerLink.start_threads`); a
simulation (``inprocess.py``) calls :meth:`poll`, :meth:`pump` and :meth:`heartbeat` from its
own event loop instead. The training loop only ever reads the inbox and fills the outbox."""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ddiloco.learner_worker.cadence import Cadence, CadencePolicy, LinkRates, QueueState, choose_cadence, measure_window_s
from ddiloco.learner_worker.device import Staged
from ddiloco.platform.compact import CompactError, CompactRef, Ref, plan_download
from ddiloco.platform.compression import CompactBase, CompressionError, apply_encoded, encode_delta
from ddiloco.platform.faults import fault_point
from ddiloco.platform.ids import learner_state_key, submission_key
from ddiloco.platform.ledger import queries as q
from ddiloco.platform.ledger.models import Learner as LearnerRow
from ddiloco.platform.run_state import read_version
from ddiloco.platform.runtime import RunContext, ledger_retry, to_datetime
from ddiloco.platform.spans import span
from ddiloco.platform.store import FragmentStore, StoreError

log = logging.getLogger("ddiloco.learner")

UPLOAD_BATCH = 32
"""Most submissions registered in one ledger transaction by the upload thread."""
REGISTER_WITHIN_S = 1.0
"""A written blob waits at most about this long for its ledger row: the upload registers what it has written
once its batch has taken this long, so on a slow link an increment does not grow stale behind the others."""
CADENCE_EVENT = "link_cadence"
"""The event a learner records when it changes its send period or codec."""

Tensors = dict[str, torch.Tensor]
Arrival = tuple[int, Tensors]
"""(global version, the fragment's tensors as stored)."""


class RunNotReadyError(RuntimeError):
    """The run has no published global version yet."""


@dataclass
class Increment:
    """base − current of one fragment, where either side may still be a host copy in flight."""

    base: Tensors | Staged
    current: Tensors | Staged

    def resolve(self) -> Tensors:
        base = self.base.wait() if isinstance(self.base, Staged) else self.base
        current = self.current.wait() if isinstance(self.current, Staged) else self.current
        with torch.no_grad():
            return {n: base[n] - current[n] for n in current}


@dataclass
class Outgoing:
    """One submission on its way: the outer-gradient increments of a fragment and their counts."""

    fragment: int
    base_version: int
    parts: list[Increment | Tensors]
    c_steps: int
    c_tokens: int
    tokens_new: int
    tokens_total: int
    step: int
    created_at: float
    data_batches: int | None = None
    """Micro-batches each rank had drawn when this was sent."""

    def delta(self) -> Tensors:
        """The sum of the parts (a send plus increments of failed uploads it carries)."""
        total: Tensors | None = None
        for part in self.parts:
            d = part.resolve() if isinstance(part, Increment) else part
            total = d if total is None else {n: total[n] + d[n] for n in total}
        assert total is not None
        return total

    def coalesce(self, newer: Outgoing) -> None:
        """Take a newer increment of the same fragment into this queued one (one pending blob per
        fragment): parts, steps and tokens add up; the rest is the newer one's, as in :meth:`absorb`."""
        self.parts = self.parts + newer.parts
        self.c_steps += newer.c_steps
        self.c_tokens += newer.c_tokens
        self.tokens_new += newer.tokens_new
        self.base_version, self.tokens_total, self.step = newer.base_version, newer.tokens_total, newer.step
        self.created_at = newer.created_at
        if newer.data_batches is not None:
            self.data_batches = newer.data_batches

    def absorb(self, older: Outgoing) -> None:
        """Carry an older, unsent increment of the same fragment in this one."""
        self.parts = older.parts + self.parts
        self.c_steps += older.c_steps
        self.c_tokens += older.c_tokens
        self.tokens_new += older.tokens_new
        if self.data_batches is None:
            self.data_batches = older.data_batches


class LinkMeter:
    """The transfers a link completed (the newest ``keep`` each way) and those under way, and the rates
    they show over a window. Directions: ``up`` (submissions) and ``down`` (global versions)."""

    def __init__(self, start: float, keep: int = 256) -> None:
        self.start = start
        self._lock = threading.Lock()
        self._done: dict[str, deque[tuple[float, float, int]]] = {d: deque(maxlen=keep) for d in ("up", "down")}
        self._active: dict[int, tuple[str, float]] = {}
        self._next = 0

    def begin(self, direction: str, now: float) -> int:
        """A transfer starts at ``now``; the token ends it."""
        with self._lock:
            self._next += 1
            self._active[self._next] = (direction, now)
            return self._next

    def end(self, token: int, nbytes: int, seconds: float, now: float) -> None:
        """The transfer of ``token`` moved ``nbytes`` in ``seconds`` and ended at ``now`` (0 bytes: it failed)."""
        with self._lock:
            direction, _ = self._active.pop(token)
            if nbytes > 0:
                self._done[direction].append((now, max(0.0, seconds), nbytes))

    def rates(self, now: float, window_s: float) -> LinkRates:
        """Bytes/s while transferring and the busy share, each way, over the last ``window_s`` (a rate falls
        back to the newest few transfers when none ended in the window: a slow link still has one)."""
        span = max(1e-9, min(window_s, now - self.start))
        out: dict[str, tuple[float | None, float]] = {}
        with self._lock:
            for d, done in self._done.items():
                recent = [t for t in done if t[0] >= now - span]
                busy = sum(min(sec, end - (now - span)) for end, sec, _ in recent)
                busy += sum(min(now - t0, span) for dd, t0 in self._active.values() if dd == d)
                sample = recent or list(done)[-4:]
                seconds, nbytes = sum(t[1] for t in sample), sum(t[2] for t in sample)
                rate = None if not sample else (nbytes / seconds if seconds > 0 else math.inf)
                out[d] = (rate, min(1.0, busy / span))
        return LinkRates(out["up"][0], out["down"][0], out["up"][1], out["down"][1], span)


@dataclass(frozen=True)
class HeartbeatStats:
    step: int
    tokens: int
    loss: float | None
    tokens_per_s: float
    step_time_s: float
    busy_s: float


@dataclass
class Upload:
    """An upload begun by :meth:`LearnerLink.begin_upload`: its blobs are written, its rows not yet."""

    outs: list[Outgoing]
    subs: list[q.SubmissionIn]
    token: int
    """The link meter's transfer."""


@dataclass
class SavedState:
    """AdamW's state queued for saving, in order with the uploads."""

    tensors: Tensors
    step: int


@dataclass
class Resume:
    """What a new incarnation takes over from the previous ones."""

    optimizer: Tensors | None = None
    """The newest saved AdamW state, if any could be read."""
    data_batches: int = 0
    """Micro-batches each rank had drawn at the newest registered submission: where the data goes on."""


@dataclass
class LearnerLink:
    ctx: RunContext
    learner_id: str
    region: str
    flow_run_url: str | None = None
    incarnation: int = -1
    run_finished: bool = False
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_if_whole: int = 0
    """What the versions received would have cost downloaded whole (float32): ``bytes_received``'s baseline."""
    downloads: int = 0
    """Versions received."""
    delta_codecs: dict[str, int] = field(default_factory=dict)
    """Compact downloads by the codec of their delta."""
    upload_s: float = 0.0
    awaiting: set[int] = field(default_factory=set)
    """Overlap 0: fragments sent whose merged version has not arrived yet."""
    num_fragments: int = field(default=0, init=False)
    """The fragments of the learner's model (:meth:`configure`)."""
    cadence: Cadence | None = field(default=None, init=False)
    """The send period and codec in force (:meth:`set_cadence`; :meth:`choose` changes it when adaptive)."""
    cadence_policy: CadencePolicy | None = field(default=None, init=False)
    """What an adaptive learner may choose from (None: the cadence is fixed; :meth:`configure`)."""
    elapsed: Callable[[], float] = time.perf_counter
    """What transfers are timed with; a simulation times them on its own clock."""

    def __post_init__(self) -> None:
        self._lock = threading.Condition()
        self._inbox: dict[int, Arrival] = {}
        self._delivered: dict[int, int] = {}
        """Newest version put in the inbox per fragment: what the learner holds or is about to."""
        self._bases: dict[int, CompactBase] = {}
        """Per fragment, the base of the compact downloads this learner holds (as the synchronizer does)."""
        self._receive_lock = threading.Lock()
        self._heads: dict[int, q.HeadRef] = {}
        """The newest head seen of each fragment (an exchange returns only newer ones; a skipped one is taken later)."""
        self._sent_since: set[int] = set()
        """Fragments sent since their last download (a link-limited learner downloads each once per send)."""
        self._outbox: queue.Queue = queue.Queue()
        self._carry: dict[int, Outgoing] = {}
        self._queued: dict[int, Outgoing] = {}
        """The submission of each fragment waiting in the outbox, not yet taken by an upload."""
        self._queued_since: dict[int, float] = {}
        self.coalesced = 0
        """Sends folded into one already queued (uploads not keeping pace with training)."""
        self.cadence_changes = 0
        """Times an adaptive learner changed its send period or codec."""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_heartbeat: float | None = None
        self._stats: Callable[[], HeartbeatStats] | None = None
        self._exchange_lock = threading.Lock()
        self._last_exchange = -float("inf")
        self.meter = LinkMeter(self.ctx.now())
        self._events: list[tuple[str, str]] = []
        """Events for the next exchange to record (cadence changes)."""

    def configure(self, num_fragments: int, cadence_policy: CadencePolicy | None) -> None:
        """The learner's model: its fragments, and what it may choose its cadence from (None: fixed)."""
        self.num_fragments = num_fragments
        self.cadence_policy = cadence_policy

    def set_cadence(self, cadence: Cadence) -> None:
        """The cadence in force from now on (the learner's first; :meth:`choose` changes it when adaptive)."""
        self.cadence = cadence

    # --- joining ------------------------------------------------------------------------------

    def join(self, now: float) -> Resume:
        """Fetch every fragment's newest version, then register a new incarnation; what it resumes from."""
        with self.ctx.reading() as s:
            q.require_run(s, self.ctx.run_id)
        self.poll()
        missing = [p for p in range(self.num_fragments) if p not in self._delivered]
        if missing:
            raise RunNotReadyError(f"run {self.ctx.run_id!r} has no global version of fragments {missing} yet")
        # Registered only once ready, so a learner waiting for version 0 does not pile up incarnations.
        with self.ctx.transaction() as s:
            self.incarnation = q.register_learner(
                s, self.ctx.run_id, self.learner_id, self.region, to_datetime(now),
                host=socket.gethostname(), pid=os.getpid(), flow_run_url=self.flow_run_url,
            )
            row = s.get(LearnerRow, (self.ctx.run_id, self.learner_id))
            key, sha = (row.optimizer_state_key, row.optimizer_state_sha256) if row else (None, None)
            position = row.data_batches if row is not None and row.data_batches is not None else 0
        self._last_heartbeat = None
        resume = Resume(data_batches=max(0, int(position)))
        if key and sha and self.incarnation > 0:
            try:
                resume.optimizer = self.ctx.store(self.region).get(key, sha)
            except StoreError as err:
                log.warning("optimizer state %s unreadable (%s): starting AdamW afresh", key, err)
        return resume

    def join_when_ready(self, timeout_s: float, now: Callable[[], float]) -> Resume:
        """:meth:`join`, retrying while the synchronizer has not yet published version 0."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.join(now())
            except (RunNotReadyError, q.UnknownRunError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(self.ctx.cfg.learners.poll_s)

    # --- receiving ----------------------------------------------------------------------------

    def poll(self) -> list[int]:
        """Download every fragment with a newer global version than the one held; returns them.

        A joined learner polls through :meth:`exchange` (its heartbeat rides along); before joining it only reads."""
        if self.incarnation >= 0:
            return self.exchange()
        with span("learner.poll"):
            with self.ctx.reading() as s:
                status, heads = q.poll_run(s, self.ctx.run_id)
            return self._receive(status, heads)

    def exchange(self, subs: list[q.SubmissionIn] | None = None, *, force_history: bool = False) -> list[int]:
        """One ledger transaction for everything a step says and asks: register ``subs``, write the live
        figures (kept as a heartbeat row every ``learners.heartbeat_s``), read the run's status and every
        fragment's head; then download the newer versions. Returns the fragments downloaded."""
        with span("learner.exchange"), self._exchange_lock:
            now = self.ctx.now()
            beat = None
            if self._stats is not None:
                history = force_history or self._last_heartbeat is None or now - self._last_heartbeat >= self.ctx.cfg.learners.heartbeat_s
                hb = self._stats()
                waiting = self.queue_state(now)
                beat = q.Beat(hb.step, hb.tokens, hb.loss, hb.tokens_per_s, hb.step_time_s, hb.busy_s, history=history,
                              queue_depth=waiting.depth, oldest_unsent_s=round(waiting.oldest_unsent_s, 3),
                              link_json=self.link_json(now, hb.step_time_s))
            with self._lock:
                events, self._events = self._events, []
            try:
                result = self._commit_exchange(subs or [], beat, now, events, {p: h.version for p, h in self._heads.items()})
            except BaseException:
                with self._lock:
                    self._events[:0] = events
                raise
            for p, head in result.heads.items():
                if head.version > self._heads.get(p, head._replace(version=-1)).version:
                    self._heads[p] = head
            heads = dict(self._heads)
            self._last_exchange = now
            if beat is not None and beat.history and beat.loss is not None:
                # Until the first loss exists a heartbeat row is not yet the one charts need: the next exchange writes one.
                self._last_heartbeat = now
        return self._receive(result.run_status, heads)

    @ledger_retry
    def _commit_exchange(self, subs: list[q.SubmissionIn], beat: q.Beat | None, now: float,
                         events: list[tuple[str, str]], known: dict[int, int]) -> q.Exchange:
        with self.ctx.transaction() as s:
            return q.learner_exchange(s, self.ctx.run_id, self.learner_id, self.incarnation, subs, beat, to_datetime(now),
                                      events=events, known=known)

    def _receive(self, status: str | None, heads: dict[int, q.HeadRef]) -> list[int]:
        """Note the run's end; download every head newer than what the learner holds into the inbox."""
        if status is not None and status != "running":
            self.run_finished = True
        store = self.ctx.store()
        got = []
        # One thread downloads at a time: the bases change with each download, and a version is fetched once.
        with span("learner.poll"), self._receive_lock:
            for p, row in sorted(heads.items()):
                if p >= self.num_fragments or row.version <= self._delivered.get(p, -1) or self._skips(p):
                    continue
                t0, token = self.elapsed(), self.meter.begin("down", self.ctx.now())
                try:
                    tensors, nbytes = self._download(store, row)
                    self.meter.end(token, nbytes, self.elapsed() - t0, self.ctx.now())
                except BaseException as err:
                    self.meter.end(token, 0, 0.0, self.ctx.now())
                    if not isinstance(err, StoreError):
                        raise
                    # A version whose blob was already collected: a newer one is published; take that next time.
                    log.warning("could not read fragment %s v%s: %s", p, row.version, err)
                    continue
                fault_point("learner.after_download")
                with self._lock:
                    if row.version <= self._delivered.get(p, -1):
                        continue  # the other thread's exchange brought it (or a newer one) meanwhile
                    self._inbox[p] = (row.version, tensors)
                    self._delivered[p] = row.version
                    self._sent_since.discard(p)
                    self.downloads += 1
                    self.bytes_received += nbytes
                    self.bytes_if_whole += row.nbytes
                    self._lock.notify_all()
                got.append(p)
        return got

    def _skips(self, p: int) -> bool:
        """A learner whose link holds it to a longer send period than H takes a fragment's newer version once per
        send of it (and whenever it waits for one): versions in between would cost its link bytes its sends need."""
        c, policy = self.cadence, self.cadence_policy
        if c is None or policy is None or c.every <= policy.period:
            return False
        with self._lock:
            return p in self._delivered and p not in self.awaiting and p not in self._sent_since

    def _download(self, store: FragmentStore, row: q.HeadRef) -> tuple[Tensors, int]:
        """A version's tensors and the bytes fetched for them: by its compact form when the run publishes one (the
        blobs :func:`plan_download` picks; within the download codec's bound of the full blob), else the full blob."""
        try:
            ref = CompactRef.parse(row.compact_json)
        except CompactError as err:
            log.warning("fragment %s v%s: %s; downloading it whole", row.fragment, row.version, err)
            ref = None
        if ref is None:
            return read_version(store, row), row.nbytes
        held = self._bases.get(row.fragment)
        plan = plan_download(held.version if held else None, ref)
        fetched = 0

        def get(blob: Ref) -> tuple[Tensors, dict[str, str]]:
            nonlocal fetched
            tensors, meta = store.get_with_metadata(blob.key, blob.sha256, blob.nbytes)
            fetched += blob.nbytes
            return tensors, meta

        try:
            if plan[0] == "base":
                base = CompactBase(ref.base, {n: t.to(torch.float32) for n, t in get(ref.base_blob)[0].items()})
            elif plan[0] == "step":
                assert held is not None and ref.step is not None
                base = CompactBase(ref.base, apply_encoded(held.tensors, *get(ref.step)))
            else:
                assert held is not None
                base = held
            # A learner whose link holds it to a cheaper upload codec takes the delta in that codec when offered.
            prefer = self.cadence.codec if self.cadence is not None and self.cadence_policy is not None else None
            delta = ref.delta_for(prefer)
            tensors = apply_encoded(base.tensors, *get(delta))
            codec = ref.codec if delta is ref.delta else str(prefer)
            self.delta_codecs[codec] = self.delta_codecs.get(codec, 0) + 1
        except CompressionError as err:
            # The synchronizer wrote these blobs and their hashes matched; a form that does not fit is a bug there:
            # drop the base and take the full blob, which never depends on one.
            log.warning("fragment %s v%s: compact form unusable (%s); downloading it whole", row.fragment, row.version, err)
            self._bases.pop(row.fragment, None)
            return read_version(store, row), fetched + row.nbytes
        self._bases[row.fragment] = base
        return tensors, fetched

    def io_figures(self) -> tuple[int, int]:
        """(uploads queued, newest global version received of any fragment, -1 before the first), for /metrics."""
        with self._lock:
            return self._outbox.qsize(), max(self._delivered.values(), default=-1)

    def take_arrivals(self) -> tuple[dict[int, Arrival], set[int]]:
        """The fragments that arrived since the last call, and those still awaited (overlap 0)."""
        with self._lock:
            arrived, self._inbox = self._inbox, {}
            self.awaiting.difference_update(arrived)
            return arrived, set(self.awaiting)

    def put_back(self, arrived: dict[int, Arrival]) -> None:
        """Arrivals taken but not applied (the learner stopped): keep them."""
        with self._lock:
            for p, item in arrived.items():
                self._inbox.setdefault(p, item)

    def wait_for_awaited(self, timeout_s: float) -> bool:
        """Overlap 0: block until every awaited fragment has arrived (True) or time runs out."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.awaiting and not self.awaiting <= set(self._inbox) and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    # --- sending ------------------------------------------------------------------------------

    def submit(self, out: Outgoing, *, await_merge: bool = False) -> None:
        """Queue a fragment's increment; one whose earlier upload failed goes out with it."""
        with self._lock:
            self._sent_since.add(out.fragment)
            carried = self._carry.pop(out.fragment, None)
            if carried is not None:
                out.absorb(carried)
            if await_merge:
                self.awaiting.add(out.fragment)
            queued = self._queued.get(out.fragment)
            if queued is not None:
                # The queue holds at most one blob per fragment: a slow link sends fewer, larger
                # increments instead of an ever longer backlog of ever staler ones.
                queued.coalesce(out)
                self.coalesced += 1
                return
            self._queued[out.fragment] = out
            self._queued_since[out.fragment] = out.created_at
        self._outbox.put(out)

    def _taken(self, items: list[object]) -> None:
        """Items the upload took from the outbox: later sends of their fragments queue anew."""
        with self._lock:
            for item in items:
                if isinstance(item, Outgoing) and self._queued.get(item.fragment) is item:
                    del self._queued[item.fragment]
                    del self._queued_since[item.fragment]

    def oldest_unsent_s(self, now: float) -> float:
        """Age of the oldest increment waiting in the outbox (0 when none waits)."""
        return self.queue_state(now).oldest_unsent_s

    def queue_state(self, now: float) -> QueueState:
        """How many fragments wait in the outbox, and for how long the oldest has."""
        with self._lock:
            return QueueState(len(self._queued), max((now - t for t in self._queued_since.values()), default=0.0))

    # --- cadence ------------------------------------------------------------------------------

    def choose(self, now: float, step_s: float) -> Cadence:
        """The cadence from ``now`` on: fixed, or what :func:`choose_cadence` makes of the link (a change is
        recorded as an event by the next exchange)."""
        assert self.cadence is not None, "the learner sets the link's cadence"
        policy = self.cadence_policy
        if policy is None:
            return self.cadence
        old = self.cadence
        rates = self.meter.rates(now, measure_window_s(old.every, step_s, policy.hold_periods))
        new = choose_cadence(now, rates, self.queue_state(now), step_s, old, policy)
        if new is not old:
            self.cadence = new
            if (new.every, new.codec) != (old.every, old.codec):
                self.cadence_changes += 1
                log.info("learner %s sends every %s steps with %s: %s", self.learner_id, new.every, new.codec, new.reason)
                with self._lock:
                    self._events.append((CADENCE_EVENT, f"every {new.every} steps with {new.codec} "
                                                        f"(was every {old.every} with {old.codec}): {new.reason}"))
        return new

    def link_json(self, now: float, step_s: float) -> str | None:
        """The link's measured rates and the cadence in force with its reason, as written to the ledger."""
        c = self.cadence
        if c is None:
            return None
        r = self.meter.rates(now, measure_window_s(c.every, step_s))

        def num(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else round(x, 1)

        return json.dumps({
            "adaptive": self.cadence_policy is not None, "every": c.every, "codec": c.codec, "reason": c.reason,
            "since": round(c.since, 3), "up_bps": num(r.up_bps), "down_bps": num(r.down_bps),
            "up_busy": round(r.up_busy, 3), "down_busy": round(r.down_busy, 3), "window_s": round(r.window_s, 1),
        }, separators=(",", ":"))

    def submit_state(self, tensors: Tensors, step: int) -> None:
        """Queue AdamW's state for saving, in order with the uploads."""
        self._outbox.put(SavedState(tensors, step))

    def pump(self) -> None:
        """Upload everything queued, on this thread (simulations and the final flush)."""
        while True:
            try:
                items = [self._outbox.get_nowait()]
            except queue.Empty:
                return
            self._taken(items)
            self._handle(items)

    def _handle(self, items: list[object]) -> bool:
        """Save states and upload submissions; True when the stop marker was among them."""
        for item in items:
            if isinstance(item, SavedState):
                try:
                    self.save_optimizer_state(item)
                except Exception:  # noqa: BLE001 - a missed save only costs a colder restart
                    log.exception("saving the optimizer state failed")
        outs = [item for item in items if isinstance(item, Outgoing)]
        if outs:
            registered: list[Outgoing] = []
            try:
                self.upload(outs, registered)
            except Exception:  # noqa: BLE001 - the increments go out with the next send
                log.exception("upload of fragments %s failed after retries", [o.fragment for o in outs])
                self._carry_over([o for o in outs if not any(o is r for r in registered)])
        return any(item is None for item in items)

    def upload(self, outs: list[Outgoing], registered: list[Outgoing] | None = None) -> None:
        """Write the blobs and register them: a row never points to a missing blob. A fast batch is one
        transaction; on a slow link what is written is registered every :data:`REGISTER_WITHIN_S` (appended to
        ``registered``, so that a failure carries over only the rest)."""
        t0 = time.perf_counter()
        done = [] if registered is None else registered
        with span("learner.upload"):
            written: list[tuple[Outgoing, q.SubmissionIn]] = []
            since = self.elapsed()
            for i, out in enumerate(outs):
                token, started = self.meter.begin("up", self.ctx.now()), self.elapsed()
                subs: list[q.SubmissionIn] = []
                try:
                    subs = self.put_blobs([out])
                finally:
                    # The link's figure is the blob's transfer; the registration is a ledger round trip.
                    self.meter.end(token, sum(sub.nbytes for sub in subs), self.elapsed() - started, self.ctx.now())
                written.append((out, subs[0]))
                if i == len(outs) - 1 or self.elapsed() - since >= REGISTER_WITHIN_S:
                    self._register([sub for _, sub in written])
                    done += [o for o, _ in written]
                    self.bytes_sent += sum(sub.nbytes for _, sub in written)
                    written, since = [], self.elapsed()
        self.upload_s += time.perf_counter() - t0

    def put_blobs(self, outs: list[Outgoing]) -> list[q.SubmissionIn]:
        """Encode each submission with the codec in force and write its blob; what to register."""
        cfg = self.ctx.cfg.compression
        codec = self.cadence.codec if self.cadence is not None else cfg.codec
        store = self.ctx.store(self.region)
        subs = []
        for out in outs:
            tensors, meta = encode_delta(out.delta(), codec, cfg.block_size)
            uid = f"i{self.incarnation}-s{out.step}-f{out.fragment}"
            blob = store.put(submission_key(self.ctx.run_id, out.fragment, self.learner_id, uid), tensors, meta)
            fault_point("learner.after_blob")
            subs.append(
                q.SubmissionIn(
                    uid=uid, fragment=out.fragment, base_version=out.base_version, c_steps=out.c_steps,
                    c_tokens=out.c_tokens, tokens_new=out.tokens_new, tokens_total=out.tokens_total,
                    blob_key=blob.key, sha256=blob.sha256, nbytes=blob.nbytes, codec=codec,
                    data_batches=out.data_batches,
                )
            )
        return subs

    def begin_upload(self) -> Upload | None:
        """Take the oldest queued submission (saving any state queued before it) and write its blob: an upload
        whose transfer a simulation times on its own clock, then ends with :meth:`finish_upload` (None: nothing
        queued). One blob at a time: a blob whose transfer takes :data:`REGISTER_WITHIN_S` or longer is registered
        on its own by the upload thread too."""
        items: list[object] = []
        while not any(isinstance(item, Outgoing) for item in items):
            try:
                items.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        if not items:
            return None
        self._taken(items)
        self._handle([item for item in items if isinstance(item, SavedState)])
        outs = [item for item in items if isinstance(item, Outgoing)]
        token = self.meter.begin("up", self.ctx.now())
        try:
            return Upload(outs, self.put_blobs(outs) if outs else [], token)
        except Exception:  # noqa: BLE001 - the increments go out with the next send
            log.exception("upload of fragments %s failed", [o.fragment for o in outs])
            self._carry_over(outs)
            return Upload([], [], token)

    def finish_upload(self, up: Upload, seconds: float) -> None:
        """End an upload begun by :meth:`begin_upload` whose blobs took ``seconds`` to cross: register them."""
        self.meter.end(up.token, sum(sub.nbytes for sub in up.subs), seconds, self.ctx.now())
        if not up.subs:
            return
        try:
            self._register(up.subs)
        except Exception:  # noqa: BLE001 - the increments go out with the next send
            log.exception("registering fragments %s failed", [o.fragment for o in up.outs])
            self._carry_over(up.outs)
            return
        self.bytes_sent += sum(sub.nbytes for sub in up.subs)

    def _register(self, subs: list[q.SubmissionIn]) -> None:
        """Register in the step's one exchange (which also heartbeats and polls)."""
        self.exchange(subs)

    def _carry_over(self, outs: list[Outgoing]) -> None:
        """Keep the increments of failed uploads: the next send of their fragment carries them."""
        with self._lock:
            for out in outs:
                prev = self._carry.pop(out.fragment, None)
                if prev is not None:
                    out.absorb(prev)
                self._carry[out.fragment] = out
                self.awaiting.discard(out.fragment)
            self._lock.notify_all()

    # --- optimizer state ----------------------------------------------------------------------

    def save_optimizer_state(self, state: SavedState) -> None:
        store = self.ctx.store(self.region)
        key = learner_state_key(self.ctx.run_id, self.learner_id, f"optim-i{self.incarnation}-s{state.step}")
        blob = store.put(key, state.tensors)
        with self.ctx.transaction() as s:
            old = q.set_optimizer_state(s, self.ctx.run_id, self.learner_id, blob.key, blob.sha256)
        if old and old != blob.key:
            store.delete(old)

    # --- heartbeats and threads ---------------------------------------------------------------

    def heartbeat(self, now: float, stats: Callable[[], HeartbeatStats], force: bool = False) -> None:
        """Record progress at most every ``learners.heartbeat_s`` (always with ``force``): an exchange, so it polls too.

        Between heartbeats every exchange (a registration, a poll) writes the live figures anyway."""
        self._stats = stats
        if not force and self._last_heartbeat is not None and now - self._last_heartbeat < self.ctx.cfg.learners.heartbeat_s:
            return
        self.exchange(force_history=True)

    def start_threads(self, stats: Callable[[], HeartbeatStats]) -> None:
        """Upload and poll (with heartbeats) in the background until :meth:`stop`."""
        self._stats = stats
        for target, name in ((self._upload_loop, "upload"), (lambda: self._poll_loop(stats), "poll")):
            t = threading.Thread(target=target, name=f"{self.learner_id}-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, stats: Callable[[], HeartbeatStats], timeout_s: float = 30.0) -> None:
        """Finish the queued uploads, stop the threads, and send a last heartbeat."""
        self._outbox.put(None)
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        for t in self._threads:
            t.join(timeout=timeout_s)
        if not self._threads:
            self.pump()
        self.heartbeat(self.ctx.now(), stats, force=True)

    def _upload_loop(self) -> None:
        finished = False
        while not finished:
            items = [self._outbox.get()]
            # Whatever else is already queued goes in the same ledger transaction.
            while len(items) < UPLOAD_BATCH:
                try:
                    items.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            self._taken(items)
            finished = self._handle(items)

    def _poll_loop(self, stats: Callable[[], HeartbeatStats]) -> None:
        while not self._stop.is_set():
            try:
                # A registration's exchange polls too: a separate poll only when none was made for poll_s.
                if self.ctx.now() - self._last_exchange >= self.ctx.cfg.learners.poll_s:
                    self.poll()
            except Exception:  # noqa: BLE001 - the ledger or store may be restarting; try again
                log.exception("poll failed; retrying")
            self._stop.wait(self.ctx.cfg.learners.poll_s)
