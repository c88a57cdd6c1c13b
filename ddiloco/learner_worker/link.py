"""A learner's link to its run: rank 0's ledger and store I/O, off the training thread.

The link registers incarnations, exchanges with the ledger (registrations, live figures, heartbeats and the
newest heads in one transaction), chooses the cadence, and runs the I/O threads around its parts: the
``Outbox`` the training thread fills, the ``Uploader`` that empties it, the ``Downloader`` that fills the inbox.
In a process its upload and poll threads run in the background (:meth:`LearnerLink.start_threads`); a
simulation (``inprocess.py``) calls :meth:`poll`, ``uploader.pump`` and :meth:`heartbeat` from its own loop."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ddiloco.learner_worker.cadence import (
    WEIGH_EVERY_S,
    Cadence,
    CadencePolicy,
    choose_cadence,
    link_report,
    measure_window_s,
)
from ddiloco.learner_worker.downloader import Arrival, Downloader
from ddiloco.learner_worker.linkio import IOProcess, LinkIO, LocalIO
from ddiloco.learner_worker.meter import LinkMeter
from ddiloco.learner_worker.outbox import Outbox, Outgoing
from ddiloco.learner_worker.uploader import Uploader
from ddiloco.platform.ids import learner_state_key
from ddiloco.platform.ledger import errors as errors_q
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.models import Learner as LearnerRow
from ddiloco.platform.redact import redact_url
from ddiloco.platform.runtime import RunContext, to_datetime
from ddiloco.platform.spans import span

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ddiloco.learner")

STATE_FORMAT = "dcp"
"""What the learner row records beside its state's key: the state is a torch.distributed.checkpoint directory."""

GIL_SWITCH_INTERVAL_S = 0.0005
"""The longest the link's threads keep the GIL from the training thread (CPython's default is 5 ms). The training thread
releases the GIL in every torch op and must win it back after each; behind a busy upload or poll thread it waited up to
the whole interval each time (CPU, demo model: 3.4-4.0 ms blocked a step at 5 ms, 2.6-2.9 ms at 0.5 ms)."""

CADENCE_EVENT = "link_cadence"
"""The event a learner records when it changes its send period or codec."""


class RunNotReadyError(RuntimeError):
    """The run has no published global version yet."""


@dataclass(frozen=True)
class HeartbeatStats:
    step: int
    tokens: int
    loss: float | None
    tokens_per_s: float
    step_time_s: float
    busy_s: float
    model_flops_per_s: float | None = None
    mfu: float | None = None


@dataclass
class Resume:
    """What a new incarnation takes over from the previous ones."""

    state_url: str | None = None
    """Where the newest saved state of this learner is (a torch.distributed.checkpoint directory), if any."""
    data_batches: int = 0
    """Micro-batches each rank had drawn at the newest registered submission: where the data goes on."""


@dataclass
class LearnerLink:
    """The learner's one port to its run. ``_exchange_lock`` serialises exchanges and guards ``_heads``;
    ``_events_lock`` guards ``_events``. The parts keep their own locks (see each) and never call back into
    the link while holding one."""

    ctx: RunContext
    learner_id: str
    region: str
    flow_run_url: str | None = None
    incarnation: int = -1
    run_finished: bool = False
    elapsed: Callable[[], float] = time.perf_counter
    """What transfers are timed with; a simulation times them on its own clock."""
    num_fragments: int = field(default=0, init=False)
    world_size: int = field(default=1, init=False)
    """The ranks of this learner's job, recorded at registration (set by :meth:`configure`)."""
    """The fragments of the learner's model (:meth:`configure`)."""
    cadence_policy: CadencePolicy | None = field(default=None, init=False)
    """What an adaptive learner may choose from (None: the cadence is fixed; :meth:`configure`)."""
    cadence: Cadence | None = field(default=None, init=False)
    """The send period and codec in force (:meth:`set_cadence`; :meth:`choose` changes it when adaptive)."""

    def __post_init__(self) -> None:
        self.meter = LinkMeter(self.ctx.now())
        self.outbox = Outbox()
        self.downloader = Downloader(self.ctx, self.meter, self.elapsed)
        self.uploader = Uploader(
            self.ctx, self.learner_id, self.region, self.outbox, self.meter,
            incarnation=lambda: self.incarnation, codec=self._upload_codec, register=self.exchange,
            failed=self._carry_over, elapsed=self.elapsed,
        )
        self.cadence_changes = 0
        """Times an adaptive learner changed its send period or codec."""
        self._heads: dict[int, learner_q.HeadRef] = {}
        """The newest head seen of each fragment (an exchange returns only newer ones; a skipped one is taken later)."""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_heartbeat: float | None = None
        self._stats: Callable[[], HeartbeatStats] | None = None
        self._exchange_lock = threading.Lock()
        self._last_exchange = -float("inf")
        self._weighed_at = -float("inf")
        """When :meth:`choose` last weighed the cadence."""
        self._events_lock = threading.Lock()
        self._events: list[tuple[str, str]] = []
        """Events for the next exchange to record (cadence changes)."""
        self.io: LinkIO = LocalIO(self.ctx)
        """The exchanges', uploads' and downloads' ledger and store I/O: in this process, or from :meth:`start_threads`
        on in a process of its own when ``learners.link_process`` says so."""

    def configure(self, num_fragments: int, cadence_policy: CadencePolicy | None, world_size: int = 1,
                  pin_arrivals: bool = False, decode_on: torch.device | None = None) -> None:
        """The learner's model and job: its fragments, what it may choose its cadence from (None: fixed), its ranks,
        whether the versions it receives go to a GPU (then they arrive in pinned host memory), and the device that
        decodes them (None: host memory; called on the training thread, whose stream reads them)."""
        self.num_fragments = num_fragments
        self.cadence_policy = cadence_policy
        self.world_size = world_size
        self.downloader.pin = pin_arrivals and decode_on is None
        if decode_on is not None:
            self.downloader.io = LocalIO(self.ctx, decode_on)

    def set_cadence(self, cadence: Cadence) -> None:
        """The cadence in force from now on (the learner's first; :meth:`choose` changes it when adaptive)."""
        self.cadence = cadence

    # --- joining ------------------------------------------------------------------------------

    def join(self, now: float) -> Resume:
        """Fetch every fragment's newest version, then register a new incarnation; what it resumes from."""
        with self.ctx.reading() as s:
            runs_q.require_run(s, self.ctx.run_id)
        self.poll()
        missing = self.downloader.missing(self.num_fragments)
        if missing:
            raise RunNotReadyError(f"run {self.ctx.run_id!r} has no global version of fragments {missing} yet")
        # Registered only once ready, so a learner waiting for version 0 does not pile up incarnations.
        with self.ctx.transaction() as s:
            self.incarnation = learner_q.register_learner(
                s, self.ctx.run_id, self.learner_id, self.region, to_datetime(now),
                host=socket.gethostname(), pid=os.getpid(), flow_run_url=self.flow_run_url,
                world_size=self.world_size, max_world_size=self.ctx.cfg.learners.max_world_size,
            )
            row = s.get(LearnerRow, (self.ctx.run_id, self.learner_id))
            key = row.optimizer_state_key if row else None
            position = row.data_batches if row is not None and row.data_batches is not None else 0
        self._last_heartbeat = None
        resume = Resume(data_batches=max(0, int(position)))
        if key and self.incarnation > 0:
            resume.state_url = f"{self._store_url()}/{key}"
        return resume

    def state_url(self, step: int) -> str:
        """Where this incarnation saves its state at ``step`` (under the learner's own prefix of its store): a
        string only, so a store or ledger that is down cannot fail it."""
        key = learner_state_key(self.ctx.run_id, self.learner_id, f"i{self.incarnation}-s{step}")
        return f"{self._store_url()}/{key}"

    def _store_url(self) -> str:
        return self.ctx.cfg.storage_url_for(self.region).rstrip("/")

    def state_saved(self, url: str) -> None:
        """Point the learner's row at the state just saved at ``url``; the one it replaces is deleted. A ledger or
        store that is down only costs a colder restart (the previous state stays pointed at): never the learner."""
        key = url.removeprefix(self._store_url() + "/")
        try:
            with self.ctx.transaction() as s:
                old = learner_q.set_optimizer_state(s, self.ctx.run_id, self.learner_id, key, STATE_FORMAT)
        except Exception as err:  # noqa: BLE001 - see the docstring
            log.warning("could not record the saved state %s: %s", key, redact_url(str(err)))
            return
        if old and old != key:
            try:
                self.ctx.store(self.region).delete_tree(old)
            except Exception as err:  # noqa: BLE001 - a leftover only costs space (an IAM policy may forbid it)
                log.warning("could not delete the replaced state %s: %s", old, redact_url(str(err)))

    def join_when_ready(self, timeout_s: float, now: Callable[[], float]) -> Resume:
        """:meth:`join`, retrying while the synchronizer has not yet published version 0."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.join(now())
            except (RunNotReadyError, errors_q.UnknownRunError):
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
                status, heads = learner_q.poll_run(s, self.ctx.run_id)
            return self._receive(status, heads)

    def exchange(self, subs: list[learner_q.SubmissionIn] | None = None, *, force_history: bool = False) -> list[int]:
        """One ledger transaction for everything a step says and asks: register ``subs``, write the live
        figures (kept as a heartbeat row every ``learners.heartbeat_s``), read the run's status and every
        fragment's head; then download the newer versions. Returns the fragments downloaded."""
        with span("learner.exchange"), self._exchange_lock:
            now = self.ctx.now()
            beat = None
            if self._stats is not None:
                history = force_history or self._last_heartbeat is None or now - self._last_heartbeat >= self.ctx.cfg.learners.heartbeat_s
                hb = self._stats()
                waiting = self.outbox.queue_state(now)
                beat = learner_q.Beat(hb.step, hb.tokens, hb.loss, hb.tokens_per_s, hb.step_time_s, hb.busy_s, history=history,
                              queue_depth=waiting.depth, oldest_unsent_s=round(waiting.oldest_unsent_s, 3),
                              link_json=self.link_json(now, hb.step_time_s), model_flops_per_s=hb.model_flops_per_s,
                              mfu=hb.mfu)
            with self._events_lock:
                events, self._events = self._events, []
            try:
                now, result = self.io.exchange(self.learner_id, self.incarnation, subs or [], beat, events,
                                               {p: h.version for p, h in self._heads.items()})
            except BaseException:
                with self._events_lock:
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

    def _receive(self, status: str | None, heads: dict[int, learner_q.HeadRef]) -> list[int]:
        """Note the run's end; download every head newer than what the learner holds into the inbox."""
        if status is not None and status != "running":
            self.run_finished = True
        c, policy = self.cadence, self.cadence_policy
        held = c is not None and policy is not None and c.every > policy.period
        # A learner whose link holds it to a cheaper upload codec takes the delta in that codec when offered.
        prefer = c.codec if c is not None and policy is not None else None
        return self.downloader.receive(heads, self.num_fragments, once_per_send=held, prefer=prefer)

    def io_figures(self) -> tuple[int, int]:
        """(uploads queued, newest global version received of any fragment, -1 before the first), for /metrics."""
        return self.outbox.qsize(), self.downloader.newest()

    # --- what the training thread calls -------------------------------------------------------

    def submit(self, out: Outgoing, *, await_merge: bool = False) -> None:
        """Queue a fragment's increment; one whose earlier upload failed goes out with it."""
        self.downloader.sent(out.fragment, await_merge=await_merge)
        self.outbox.submit(out)

    def take_arrivals(self) -> tuple[dict[int, Arrival], set[int]]:
        """The fragments that arrived since the last call, and those still awaited (overlap 0)."""
        return self.downloader.take_arrivals()

    def put_back(self, arrived: dict[int, Arrival]) -> None:
        """Arrivals taken but not applied (the learner stopped): keep them."""
        self.downloader.put_back(arrived)

    def wait_for_awaited(self, timeout_s: float) -> bool:
        """Overlap 0: block until every awaited fragment has arrived (True) or time runs out."""
        return self.downloader.wait_for_awaited(timeout_s)

    def _carry_over(self, outs: list[Outgoing]) -> None:
        """Failed uploads: their next sends carry them, and their merges are no longer awaited."""
        # Not atomic with submit(): a send racing the carry-over of its fragment may carry the increments and yet
        # not be awaited, as a send just before the carry-over is not (overlap 0 then skips that one wait).
        self.outbox.carry_over(outs)
        self.downloader.unawait([out.fragment for out in outs])

    # --- cadence ------------------------------------------------------------------------------

    def _upload_codec(self) -> str:
        """The codec uploads are encoded with: the cadence's, else the run's."""
        return self.cadence.codec if self.cadence is not None else self.ctx.cfg.compression.codec

    def choose(self, now: float, step_s: float) -> Cadence:
        """The cadence from ``now`` on: fixed, or what :func:`choose_cadence` makes of the link, weighed at most every
        :data:`WEIGH_EVERY_S` (a change is recorded as an event by the next exchange)."""
        assert self.cadence is not None, "the learner sets the link's cadence"
        policy = self.cadence_policy
        if policy is None or now - self._weighed_at < WEIGH_EVERY_S:
            return self.cadence
        self._weighed_at = now
        old = self.cadence
        rates = self.meter.rates(now, measure_window_s(old.every, step_s, policy.hold_periods))
        new = choose_cadence(now, rates, self.outbox.queue_state(now), step_s, old, policy)
        if new is not old:
            self.cadence = new
            if (new.every, new.codec) != (old.every, old.codec):
                self.cadence_changes += 1
                log.info("learner %s sends every %s steps with %s: %s", self.learner_id, new.every, new.codec, new.reason)
                with self._events_lock:
                    self._events.append((CADENCE_EVENT, f"every {new.every} steps with {new.codec} "
                                                        f"(was every {old.every} with {old.codec}): {new.reason}"))
        return new

    def link_json(self, now: float, step_s: float) -> str | None:
        """The link's measured rates and the cadence in force with its reason, as written to the ledger."""
        c = self.cadence
        if c is None:
            return None
        return link_report(c, self.meter.rates(now, measure_window_s(c.every, step_s)), adaptive=self.cadence_policy is not None)

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
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        if self.ctx.cfg.learners.link_process:
            proc = IOProcess(self.ctx, self.learner_id, self.incarnation, self.region)
            if isinstance(self.downloader.io, LocalIO):
                proc.seed(self.downloader.io.bases)
            self.io = self.uploader.io = self.downloader.io = proc
        for target, name in ((self.uploader.serve, "upload"), (lambda: self._poll_loop(stats), "poll")):
            t = threading.Thread(target=target, name=f"{self.learner_id}-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, stats: Callable[[], HeartbeatStats], timeout_s: float = 30.0) -> None:
        """Finish the queued uploads, stop the threads, and send a last heartbeat."""
        self.outbox.close()
        self._stop.set()
        self.downloader.close()
        for t in self._threads:
            t.join(timeout=timeout_s)
        if not self._threads:
            self.uploader.pump()
        try:
            self.heartbeat(self.ctx.now(), stats, force=True)
        finally:
            self.io.close()
            self.io = self.uploader.io = self.downloader.io = LocalIO(self.ctx)

    def _poll_loop(self, stats: Callable[[], HeartbeatStats]) -> None:
        while not self._stop.is_set():
            try:
                # A registration's exchange polls too: a separate poll only when none was made for poll_s.
                if self.ctx.now() - self._last_exchange >= self.ctx.cfg.learners.poll_s:
                    self.poll()
            except Exception:  # noqa: BLE001 - the ledger or store may be restarting; try again
                log.exception("poll failed; retrying")
            self._stop.wait(self.ctx.cfg.learners.poll_s)
