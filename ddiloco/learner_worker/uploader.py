"""A learner's uploads: what its outbox holds, encoded with the codec in force, written as blobs and
registered in batches; AdamW's state saved in order with them.

In a process the link's upload thread runs :meth:`Uploader.serve`; a simulation calls :meth:`Uploader.pump`,
or :meth:`Uploader.begin_upload` and :meth:`Uploader.finish_upload` to time a transfer on its own clock."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ddiloco.learner_worker.linkio import LinkIO, LocalIO
from ddiloco.learner_worker.meter import LinkMeter
from ddiloco.learner_worker.outbox import Item, Outbox, Outgoing
from ddiloco.platform.compression import encode_delta
from ddiloco.platform.faults import fault_point
from ddiloco.platform.ids import submission_key
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.runtime import RunContext
from ddiloco.platform.spans import span
from ddiloco.platform.store import BlobInfo, encode_tensors

log = logging.getLogger("ddiloco.learner")

UPLOAD_BATCH = 32
"""Most submissions registered in one ledger transaction by the upload thread."""
WRITE_AT_ONCE = 4
"""Most blobs the upload thread writes at once. On a long path a blob's write is mostly waiting for round trips, which
writes side by side overlap: one after the other, a learner 80 ms from its store wrote ~5 small blobs a second whatever
its bandwidth, and its cadence took that for a thin link (docs/multiregion.md)."""
REGISTER_WITHIN_S = 1.0
"""A written blob waits at most about this long for its ledger row: the upload registers what it has written
once its batch has taken this long, so on a slow link an increment does not grow stale behind the others."""


@dataclass
class Upload:
    """An upload begun by :meth:`Uploader.begin_upload`: its blobs are written, its rows not yet."""

    outs: list[Outgoing]
    subs: list[learner_q.SubmissionIn]
    token: int
    """The link meter's transfer."""


class Uploader:
    """Takes the outbox's items and uploads them; what it needs of its link comes as callables.

    Only one thread uploads at a time (the upload thread, or a simulation's loop): ``bytes_sent`` and
    ``upload_s`` are its own, read by others without a lock."""

    def __init__(
        self,
        ctx: RunContext,
        learner_id: str,
        region: str,
        outbox: Outbox,
        meter: LinkMeter,
        *,
        incarnation: Callable[[], int],
        codec: Callable[[], str],
        register: Callable[[list[learner_q.SubmissionIn]], object],
        failed: Callable[[list[Outgoing]], None],
        elapsed: Callable[[], float],
    ) -> None:
        self.ctx = ctx
        self.learner_id = learner_id
        self.region = region
        self.outbox = outbox
        self.meter = meter
        self.incarnation = incarnation
        """The link's incarnation: it names the blobs."""
        self.codec = codec
        """The upload codec in force."""
        self.register = register
        """Registers submissions in the ledger (the link's exchange, which also heartbeats and polls)."""
        self.failed = failed
        """Takes the submissions whose upload failed (the link carries them over)."""
        self.elapsed = elapsed
        """What transfers are timed with; a simulation times them on its own clock."""
        self.bytes_sent = 0
        self.upload_s = 0.0
        self.io: LinkIO = LocalIO(ctx)
        """Where blobs are written (the link points it at its I/O process when it has one)."""
        # With overlap 0 the training thread waits for each merge: nothing is gained by holding its send back.
        self.linger_s = 0.0 if ctx.cfg.fragments.overlap == 0 else ctx.cfg.learners.upload_linger_s
        """How long an idle upload thread waits after a send for more to register with it (``learners.upload_linger_s``)."""

    def serve(self) -> None:
        """Upload until the outbox's stop marker: the upload thread."""
        finished = False
        while not finished:
            # Whatever else is queued, or comes within the linger, goes in the same ledger transaction.
            finished = self.handle(self.outbox.take(UPLOAD_BATCH, wait=True, linger_s=self.linger_s), at_once=WRITE_AT_ONCE)

    def pump(self) -> None:
        """Upload everything queued, on this thread (simulations and the final flush)."""
        while items := self.outbox.take():
            self.handle(items)

    def handle(self, items: list[Item], at_once: int = 1) -> bool:
        """Upload submissions, writing up to ``at_once`` blobs side by side; True when the stop marker was among them."""
        outs = [item for item in items if isinstance(item, Outgoing)]
        if outs:
            registered: list[Outgoing] = []
            try:
                self.upload(outs, registered, at_once)
            except Exception:  # noqa: BLE001 - the increments go out with the next send
                log.exception("upload of fragments %s failed after retries", [o.fragment for o in outs])
                self.failed([o for o in outs if not any(o is r for r in registered)])
        return any(item is None for item in items)

    def upload(self, outs: list[Outgoing], registered: list[Outgoing] | None = None, at_once: int = 1) -> None:
        """Write the blobs, ``at_once`` side by side, and register them: a row never points to a missing blob. A fast
        batch is one transaction; on a slow link what is written is registered every :data:`REGISTER_WITHIN_S`
        (appended to ``registered``, so that a failure carries over only the rest)."""
        t0 = time.perf_counter()
        done = [] if registered is None else registered
        at_once = max(1, at_once)
        with span("learner.upload"):
            written: list[tuple[Outgoing, learner_q.SubmissionIn]] = []
            since = self.elapsed()
            for first in range(0, len(outs), at_once):
                group = outs[first:first + at_once]
                token, started = self.meter.begin("up", self.ctx.now()), self.elapsed()
                subs: list[learner_q.SubmissionIn] = []
                try:
                    subs = self.put_blobs(group)
                finally:
                    # The link's figure is the blobs' transfer, side by side as one (what the link carried in the time
                    # it took); the registration is a ledger round trip.
                    self.meter.end(token, sum(sub.nbytes for sub in subs), self.elapsed() - started, self.ctx.now())
                written += zip(group, subs)
                if first + len(group) >= len(outs) or self.elapsed() - since >= REGISTER_WITHIN_S:
                    self.register([sub for _, sub in written])
                    done += [o for o, _ in written]
                    self.bytes_sent += sum(sub.nbytes for _, sub in written)
                    written, since = [], self.elapsed()
        self.upload_s += time.perf_counter() - t0

    def put_blobs(self, outs: list[Outgoing]) -> list[learner_q.SubmissionIn]:
        """Encode each submission with the codec in force, then write their blobs side by side; what to register."""
        codec = self.codec()
        encoded = []
        for out in outs:
            with out.stream_context():
                tensors, meta = encode_delta(out.delta(), codec, self.ctx.cfg.compression.block_size)
            uid = f"i{self.incarnation()}-s{out.step}-f{out.fragment}"
            encoded.append((uid, submission_key(self.ctx.run_id, out.fragment, self.learner_id, uid),
                            encode_tensors(tensors, meta)))
        blobs = self._write([(key, data) for _, key, data in encoded])
        return [
            learner_q.SubmissionIn(
                uid=uid, fragment=out.fragment, base_version=out.base_version, c_steps=out.c_steps,
                c_tokens=out.c_tokens, tokens_new=out.tokens_new, tokens_total=out.tokens_total,
                blob_key=blob.key, sha256=blob.sha256, nbytes=blob.nbytes, codec=codec,
                data_batches=out.data_batches,
            )
            for out, (uid, _, _), blob in zip(outs, encoded, blobs)
        ]

    def _write(self, blobs: list[tuple[str, bytes]]) -> list[BlobInfo]:
        """Write blobs, all at once (the first on this thread); return once every write has ended, raising the first
        failure. The helpers are daemon threads of one write each, so a write that never ends keeps no process alive."""
        results: list[BlobInfo | BaseException | None] = [None] * len(blobs)

        def write(i: int) -> None:
            try:
                results[i] = self.io.put_blob(self.region, *blobs[i])
                fault_point("learner.after_blob")
            except BaseException as err:  # noqa: BLE001 - raised on the upload thread below
                results[i] = err

        helpers = [threading.Thread(target=write, args=(i,), name=f"{self.learner_id}-write", daemon=True)
                   for i in range(1, len(blobs))]
        for t in helpers:
            t.start()
        if blobs:
            write(0)
        for t in helpers:
            t.join()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results  # type: ignore[return-value]

    def begin_upload(self) -> Upload | None:
        """Take the oldest queued submission and write its blob: an upload
        whose transfer a simulation times on its own clock, then ends with :meth:`finish_upload` (None: nothing
        queued). One blob at a time: a blob whose transfer takes :data:`REGISTER_WITHIN_S` or longer is registered
        on its own by the upload thread too."""
        items = self.outbox.take_submission()
        if not items:
            return None
        outs = [item for item in items if isinstance(item, Outgoing)]
        token = self.meter.begin("up", self.ctx.now())
        try:
            return Upload(outs, self.put_blobs(outs) if outs else [], token)
        except Exception:  # noqa: BLE001 - the increments go out with the next send
            log.exception("upload of fragments %s failed", [o.fragment for o in outs])
            self.failed(outs)
            return Upload([], [], token)

    def finish_upload(self, up: Upload, seconds: float) -> None:
        """End an upload begun by :meth:`begin_upload` whose blobs took ``seconds`` to cross: register them."""
        self.meter.end(up.token, sum(sub.nbytes for sub in up.subs), seconds, self.ctx.now())
        if not up.subs:
            return
        try:
            self.register(up.subs)
        except Exception:  # noqa: BLE001 - the increments go out with the next send
            log.exception("registering fragments %s failed", [o.fragment for o in up.outs])
            self.failed(up.outs)
            return
        self.bytes_sent += sum(sub.nbytes for sub in up.subs)
