"""A learner's downloads: the newer global versions its link's exchanges show, fetched into the inbox the
training thread takes them from.

A version is fetched by its link's I/O (``linkio.py``: by its compact form against the base the learner holds when
the run publishes one, else whole); a link-limited learner takes a fragment's newer version once per send of it.
Overlap 0: the fragments sent whose merged version has not arrived yet are awaited here."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ddiloco.learner_worker.linkio import LinkIO, LocalIO
from ddiloco.learner_worker.meter import LinkMeter
from ddiloco.platform.compression import Tensors
from ddiloco.platform.faults import fault_point
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.runtime import RunContext
from ddiloco.platform.spans import span
from ddiloco.platform.store import StoreError

log = logging.getLogger("ddiloco.learner")

Arrival = tuple[int, Tensors]
"""(global version, the fragment's tensors as stored)."""


class Downloader:
    """Downloads into the inbox and the bookkeeping of what arrived, what is awaited and what was sent.

    ``_lock`` (a condition: waiters wake on arrivals) guards ``_inbox``, ``_delivered``, ``_awaiting``,
    ``_sent_since``, ``_closed`` and the byte counts; ``_receive_lock`` lets one thread download at a time
    and guards ``delta_codecs``. The second is never taken while holding the first."""

    def __init__(self, ctx: RunContext, meter: LinkMeter, elapsed: Callable[[], float]) -> None:
        self.ctx = ctx
        self.meter = meter
        self.elapsed = elapsed
        """What transfers are timed with."""
        self._lock = threading.Condition()
        self._inbox: dict[int, Arrival] = {}
        self._delivered: dict[int, int] = {}
        """Newest version put in the inbox per fragment: what the learner holds or is about to."""
        self._awaiting: set[int] = set()
        """Overlap 0: fragments sent whose merged version has not arrived yet."""
        self._sent_since: set[int] = set()
        """Fragments sent since their last download (a link-limited learner downloads each once per send)."""
        self._closed = False
        self.pin = False
        """Put arrivals in pinned host memory (a GPU learner's): their copy to the device then waits for nothing on the
        training thread, where from pageable memory it waited for every kernel queued before it."""
        self.downloads = 0
        """Versions received."""
        self.bytes_received = 0
        self.bytes_if_whole = 0
        """What the versions received would have cost downloaded whole (float32): ``bytes_received``'s baseline."""
        self._receive_lock = threading.Lock()
        self.delta_codecs: dict[str, int] = {}
        """Compact downloads by the codec of their delta."""
        self.io: LinkIO = LocalIO(ctx)
        """What fetches versions, and holds the bases of compact downloads (the link points it at its I/O process when
        it has one)."""

    def receive(self, heads: dict[int, learner_q.HeadRef], fragments: int, *, once_per_send: bool, prefer: str | None) -> list[int]:
        """Download every head of the learner's ``fragments`` newer than what it holds into the inbox; returns them.

        ``once_per_send``: the learner's link holds it to a longer send period than H, so it takes a fragment's
        newer version once per send of it (and whenever it waits for one): versions in between would cost its link
        bytes its sends need. ``prefer``: the delta codec to take when the run offers it (its upload codec)."""
        got = []
        # One thread downloads at a time: the I/O's bases change with each download, and a version is fetched once.
        with span("learner.poll"), self._receive_lock:
            for p, row in sorted(heads.items()):
                if p >= fragments or row.version <= self._delivered.get(p, -1) or (once_per_send and self._skips(p)):
                    continue
                t0, token = self.elapsed(), self.meter.begin("down", self.ctx.now())
                try:
                    tensors, nbytes, codec = self.io.fetch(row, prefer)
                    self.meter.end(token, nbytes, self.elapsed() - t0, self.ctx.now())
                    if codec is not None:
                        self.delta_codecs[codec] = self.delta_codecs.get(codec, 0) + 1
                except BaseException as err:
                    self.meter.end(token, 0, 0.0, self.ctx.now())
                    if not isinstance(err, StoreError):
                        raise
                    # A version whose blob was already collected: a newer one is published; take that next time.
                    log.warning("could not read fragment %s v%s: %s", p, row.version, err)
                    continue
                if self.pin:
                    tensors = {n: t.pin_memory() for n, t in tensors.items()}
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
        """A link-limited learner's fragment it holds, neither awaited nor sent since its last download."""
        with self._lock:
            return p in self._delivered and p not in self._awaiting and p not in self._sent_since

    def sent(self, fragment: int, *, await_merge: bool) -> None:
        """The learner sent ``fragment``; with ``await_merge`` (overlap 0) it waits for the merged version."""
        with self._lock:
            self._sent_since.add(fragment)
            if await_merge:
                self._awaiting.add(fragment)

    def unawait(self, fragments: list[int]) -> None:
        """Sends that failed to upload: no merged version of them is coming, so nobody waits for one."""
        with self._lock:
            self._awaiting.difference_update(fragments)
            self._lock.notify_all()

    def take_arrivals(self) -> tuple[dict[int, Arrival], set[int]]:
        """The fragments that arrived since the last call, and those still awaited (overlap 0)."""
        with self._lock:
            arrived, self._inbox = self._inbox, {}
            self._awaiting.difference_update(arrived)
            return arrived, set(self._awaiting)

    def put_back(self, arrived: dict[int, Arrival]) -> None:
        """Arrivals taken but not applied (the learner stopped): keep them."""
        with self._lock:
            for p, item in arrived.items():
                self._inbox.setdefault(p, item)

    def wait_for_awaited(self, timeout_s: float) -> bool:
        """Overlap 0: block until every awaited fragment has arrived (True) or time runs out, or :meth:`close`."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._awaiting and not self._awaiting <= set(self._inbox) and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self) -> None:
        """The link stops: nobody waits any longer."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def missing(self, fragments: int) -> list[int]:
        """The learner's fragments of which no version has arrived yet."""
        with self._lock:
            return [p for p in range(fragments) if p not in self._delivered]

    def newest(self) -> int:
        """The newest global version received of any fragment (-1 before the first)."""
        with self._lock:
            return max(self._delivered.values(), default=-1)
