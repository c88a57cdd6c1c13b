"""A learner's outbox: what the training thread sends, queued in order for the upload, one blob per fragment.

A send of a fragment that is still waiting is folded into the waiting one (a slow link sends fewer, larger
increments instead of an ever longer backlog of ever staler ones), and the increments of a failed upload
are carried by the next send of their fragment. AdamW's state is queued in order with the sends."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from ddiloco.learner_worker.cadence import QueueState
from ddiloco.learner_worker.device import Increment, fold_increments
from ddiloco.platform.compression import Tensors


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
        """The increment (sends and failed uploads' increments are summed as they join it), where it lives; call it
        in :meth:`stream_context`."""
        part = fold_increments(self.parts)
        return part.resolve() if isinstance(part, Increment) else part

    def stream_context(self) -> AbstractContextManager:
        """Where it is encoded: its side stream on a GPU (see :class:`Increment`)."""
        for part in self.parts:
            if isinstance(part, Increment) and part.stream is not None:
                return part.stream_context()
        return contextlib.nullcontext()

    def coalesce(self, newer: Outgoing) -> None:
        """Take a newer increment of the same fragment into this queued one (one pending blob per
        fragment): parts, steps and tokens add up; the rest is the newer one's, as in :meth:`absorb`."""
        self.parts = _folded(self.parts + newer.parts)
        self.c_steps += newer.c_steps
        self.c_tokens += newer.c_tokens
        self.tokens_new += newer.tokens_new
        self.base_version, self.tokens_total, self.step = newer.base_version, newer.tokens_total, newer.step
        self.created_at = newer.created_at
        if newer.data_batches is not None:
            self.data_batches = newer.data_batches

    def absorb(self, older: Outgoing) -> None:
        """Carry an older, unsent increment of the same fragment in this one."""
        self.parts = _folded(older.parts + self.parts)
        self.c_steps += older.c_steps
        self.c_tokens += older.c_tokens
        self.tokens_new += older.tokens_new
        if self.data_batches is None:
            self.data_batches = older.data_batches


def _folded(parts: list[Increment | Tensors]) -> list[Increment | Tensors]:
    """The parts summed into one at once: a fragment waiting for its upload keeps one increment on the training
    device however many sends it takes in (a stalled store would otherwise fill the GPU with fragment-sized parts)."""
    return [fold_increments(parts)] if len(parts) > 1 else parts


Item = Outgoing | None
"""What the outbox holds: a submission, or the stop marker (None)."""


class Outbox:
    """The queue between the training thread and the upload, coalescing per fragment.

    ``_lock`` guards the bookkeeping (``_queued``, ``_queued_since``, ``_carry``, ``coalesced``); the queue
    is thread-safe on its own. A submission taken but not yet forgotten as queued may still take in a send
    of its fragment: it is forgotten before it is encoded, so that send goes out with it."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Item] = queue.Queue()
        self._lock = threading.Lock()
        self._carry: dict[int, Outgoing] = {}
        """Per fragment, the increments of failed uploads, for its next send to carry."""
        self._queued: dict[int, Outgoing] = {}
        """The submission of each fragment waiting in the queue, not yet taken by an upload."""
        self._queued_since: dict[int, float] = {}
        self.coalesced = 0
        """Sends folded into one already queued (uploads not keeping pace with training)."""

    def submit(self, out: Outgoing) -> None:
        """Queue a fragment's increment; one whose earlier upload failed goes out with it."""
        with self._lock:
            carried = self._carry.pop(out.fragment, None)
            if carried is not None:
                out.absorb(carried)
            queued = self._queued.get(out.fragment)
            if queued is not None:
                # The queue holds at most one blob per fragment: a slow link sends fewer, larger
                # increments instead of an ever longer backlog of ever staler ones.
                queued.coalesce(out)
                self.coalesced += 1
                return
            self._queued[out.fragment] = out
            self._queued_since[out.fragment] = out.created_at
        self._queue.put(out)

    def close(self) -> None:
        """Queue the stop marker: the upload ends once it has taken everything before it."""
        self._queue.put(None)

    def take(self, most: int = 1, *, wait: bool = False, linger_s: float = 0.0) -> list[Item]:
        """Up to ``most`` items, oldest first (none when the queue is empty, unless ``wait``: then at least one).

        ``linger_s`` (with ``wait``): when the queue was empty, so that the first item found the taker idle, wait up to
        that long after it for more to come, unless the stop marker comes. A backlog is taken as it is, at once."""
        if not (wait and linger_s > 0):
            return self._take(lambda items: len(items) < most, wait=wait)
        try:
            items: list[Item] = [self._queue.get_nowait()]
            deadline = None
        except queue.Empty:
            items = [self._queue.get()]
            deadline = time.monotonic() + linger_s
        while len(items) < most and items[-1] is not None:
            try:
                left = 0.0 if deadline is None else deadline - time.monotonic()
                items.append(self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        self._taken(items)
        return items

    def take_submission(self) -> list[Item]:
        """The items up to and including the oldest submission (all of them when none is queued)."""
        return self._take(lambda items: not any(isinstance(item, Outgoing) for item in items))

    def _take(self, more: Callable[[list[Item]], bool], *, wait: bool = False) -> list[Item]:
        """Items, oldest first, while ``more`` says of those taken (waiting for the first with ``wait``)."""
        items: list[Item] = []
        if wait:
            items.append(self._queue.get())
        while more(items):
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        self._taken(items)
        return items

    def _taken(self, items: list[Item]) -> None:
        """Items an upload took: later sends of their fragments queue anew."""
        with self._lock:
            for item in items:
                if isinstance(item, Outgoing) and self._queued.get(item.fragment) is item:
                    del self._queued[item.fragment]
                    del self._queued_since[item.fragment]

    def carry_over(self, outs: list[Outgoing]) -> None:
        """Keep the increments of failed uploads: the next send of their fragment carries them."""
        with self._lock:
            for out in outs:
                prev = self._carry.pop(out.fragment, None)
                if prev is not None:
                    out.absorb(prev)
                self._carry[out.fragment] = out

    def queued(self) -> list[Outgoing]:
        """The submissions waiting, oldest first."""
        with self._lock:
            return list(self._queued.values())

    def qsize(self) -> int:
        """Items waiting (submissions and states to save)."""
        return self._queue.qsize()

    def queue_state(self, now: float) -> QueueState:
        """How many fragments wait in the outbox, and for how long the oldest has."""
        with self._lock:
            # Insertion order is queueing order (a coalesced send keeps its first time, a taken one is removed), so
            # the first entry is the oldest: O(1) on the training thread, which asks every step.
            oldest = next(iter(self._queued_since.values()), now)
            return QueueState(len(self._queued), max(0.0, now - oldest))

    def oldest_unsent_s(self, now: float) -> float:
        """Age of the oldest increment waiting in the outbox (0 when none waits)."""
        return self.queue_state(now).oldest_unsent_s
