"""A learner: trains its own replica and trades parameter fragments with the synchronizer.

It never waits for anyone (except in the overlap-0 mode, which is synchronous DiLoCo):
uploads and downloads run on background threads; the inner loop only swaps in fragments
that have already arrived."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from ddiloco.platform.compression import encode_delta
from ddiloco.platform.data import build_dataset
from ddiloco.platform.faults import fault_point
from ddiloco.platform.fragments import due_fragments, partition_module
from ddiloco.platform.ids import learner_state_key, submission_key
from ddiloco.platform.ledger import queries as q
from ddiloco.platform.ledger.models import Learner as LearnerRow
from ddiloco.platform.models import build_model, compute_loss
from ddiloco.platform.run_state import read_version
from ddiloco.platform.runtime import RunContext, ledger_retry, to_datetime
from ddiloco.platform.store import StoreError

log = logging.getLogger("ddiloco.learner")

UPLOAD_BATCH = 32
"""Most submissions registered in one ledger transaction by the upload thread."""


class RunNotReadyError(RuntimeError):
    """The run has no published global version yet."""


@dataclass
class Outgoing:
    fragment: int
    base_version: int
    delta: dict[str, torch.Tensor]
    c_steps: int
    c_tokens: int
    tokens_new: int
    tokens_total: int
    step: int
    created_at: float


def rebases(mode: str, base_version: int, c_steps: int) -> bool:
    """Whether a receipt rebases: only in rebase mode, onto a fragment already held, with unsent
    progress (without any, rebase is exactly overwrite)."""
    return mode == "rebase" and base_version >= 0 and c_steps > 0


def receive_tensor(param: torch.Tensor, incoming: torch.Tensor, *, rebase: bool, first: bool, alpha: float) -> None:
    """Fold one arrived global tensor into a local parameter (``incoming`` is G − S when rebasing)."""
    if rebase:
        param.add_(incoming.to(param.dtype))
    elif first or alpha >= 1.0:
        param.copy_(incoming)
    else:
        param.mul_(1 - alpha).add_(incoming.to(param.dtype), alpha=alpha)


@dataclass
class StepReport:
    step: int
    loss: float | None
    tokens: int
    submitted: list[int] = field(default_factory=list)
    received: list[int] = field(default_factory=list)
    waiting: bool = False


class Learner:
    def __init__(
        self,
        ctx: RunContext,
        learner_id: str,
        region: str,
        *,
        index: int,
        num_learners: int,
        speed: float = 1.0,
        background_io: bool = True,
        flow_run_url: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.flow_run_url = flow_run_url
        self.cfg = cfg = ctx.cfg
        self.id = learner_id
        self.region = region
        self.index = index
        self.speed = speed
        self.background_io = background_io
        self.model = build_model(cfg.model, seed=cfg.seed)
        self.model.train()
        self.fragments = partition_module(self.model, cfg.fragments.count)
        self.params = dict(self.model.named_parameters())
        self.period = cfg.fragments.period
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.inner.lr,
            betas=(cfg.inner.beta1, cfg.inner.beta2),
            weight_decay=cfg.inner.weight_decay,
        )
        self.dataset = build_dataset(cfg.data, cfg.model)
        self.num_learners = num_learners
        P = len(self.fragments)
        self.base = [-1] * P
        self.snapshot: list[dict[str, torch.Tensor]] = [{} for _ in range(P)]
        self.c_steps = [0] * P
        self.c_tokens = [0] * P
        self.awaiting: set[int] = set()
        self.step_count = 0
        self.tokens_total = 0
        self._tokens_unsubmitted = 0
        self.incarnation = -1
        self.last_loss: float | None = None
        self.last_step_s = 0.0
        self.simulated_step_s: float | None = None
        """In-process runs: the simulated duration of a step, reported instead of the measured one."""
        self._busy_since_heartbeat = 0.0
        self._last_heartbeat: float | None = None
        self._lock = threading.Condition()
        self._inbox: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        self._outbox: queue.Queue = queue.Queue()
        self._carry: dict[int, Outgoing] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.run_finished = False
        self.upload_s = 0.0
        self.bytes_sent = 0

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self, now: float | None = None) -> None:
        """Load the newest global version of every fragment, then register a new incarnation."""
        now = self.ctx.now() if now is None else now
        with self.ctx.reading() as s:
            q.require_run(s, self.ctx.run_id)
        self.poll_versions()
        with self._lock:
            # Fragments fetched by an earlier attempt wait in the inbox: they count too.
            missing = [p for p in range(len(self.fragments)) if self.base[p] < 0 and p not in self._inbox]
        if missing:
            raise RunNotReadyError(f"run {self.ctx.run_id!r} has no global version of fragments {missing} yet")
        # Registered only once ready, so a learner waiting for version 0 does not pile up incarnations.
        with self.ctx.transaction() as s:
            self.incarnation = q.register_learner(
                s, self.ctx.run_id, self.id, self.region, to_datetime(now),
                host=socket.gethostname(), pid=os.getpid(), flow_run_url=self.flow_run_url,
            )
            saved = s.get(LearnerRow, (self.ctx.run_id, self.id))
            saved_state = (saved.optimizer_state_key, saved.optimizer_state_sha256) if saved else (None, None)
        if saved_state[0] and saved_state[1] and self.incarnation > 0:
            self.load_optimizer_state(*saved_state)
        self._batches = self.train_stream()
        self.apply_received()
        self._last_heartbeat = None
        self.heartbeat(now)
        if self.background_io:
            for target, name in ((self._upload_loop, "upload"), (self._poll_loop, "poll")):
                t = threading.Thread(target=target, name=f"{self.id}-{name}", daemon=True)
                t.start()
                self._threads.append(t)

    def wait_until_ready(self, timeout_s: float = 120.0) -> None:
        """Start, retrying while the synchronizer has not yet published version 0."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.start()
                return
            except (RunNotReadyError, q.UnknownRunError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(self.cfg.learners.poll_s)

    def stop(self, flush: bool = True, timeout_s: float = 30.0) -> None:
        """Stop the background threads; with ``flush`` pending uploads are finished first."""
        if not self.background_io:
            return
        if flush:
            self._outbox.put(None)
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        for t in self._threads:
            t.join(timeout=timeout_s)
        self.heartbeat(self.ctx.now(), force=True)

    # --- the inner loop -------------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        warm = self.cfg.inner.warmup_steps
        return self.cfg.inner.lr * min(1.0, (step + 1) / warm) if warm > 0 else self.cfg.inner.lr

    # --- hooks a data-parallel learner (learner_worker/distributed.py) overrides -----------------------

    def train_stream(self):  # noqa: ANN201 - an iterator of Batch
        """This learner's batches: shard ``index`` of ``num_learners``, seeded by the incarnation."""
        return self.dataset.train_batches(
            self.index, self.num_learners, self.cfg.learners.batch_size, seed=self.cfg.seed * 1_000_003 + self.incarnation
        )

    def is_waiting(self) -> bool:
        """Overlap-0 mode: the next inner step must wait for a merged fragment."""
        return bool(self.awaiting)

    def tokens_per_step(self) -> int:
        """Tokens one inner step of this learner trains on (for the heartbeat's tokens/s)."""
        return self.cfg.learners.batch_size * self.cfg.model.seq_len

    # --- end of hooks ---------------------------------------------------------------------------

    def train_step(self) -> tuple[float, int]:
        """One AdamW step on the next batch of this learner's shard: (loss, tokens)."""
        batch = next(self._batches)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step_count)
        loss, _metrics = compute_loss(self.model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        fault_point("learner.mid_step")
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
        self.optimizer.step()
        return float(loss.detach()), batch.tokens

    def step(self, now: float | None = None) -> StepReport:
        """Apply arrived fragments, run one inner step, send the fragments that are due."""
        received = self.apply_received()
        if self.is_waiting():
            return StepReport(self.step_count, None, 0, received=received, waiting=True)
        t0 = time.perf_counter()
        loss, tokens = self.train_step()
        compute_s = time.perf_counter() - t0
        if self.speed < 1.0 and self.background_io:
            # Emulates slower hardware: the step takes 1/speed as long.
            self._stop.wait(compute_s * (1.0 / self.speed - 1.0))
        step_s = time.perf_counter() - t0 if self.simulated_step_s is None else self.simulated_step_s
        self.step_count += 1
        self.tokens_total += tokens
        with self._lock:
            self._tokens_unsubmitted += tokens
        self.last_loss = loss if self.last_loss is None else 0.9 * self.last_loss + 0.1 * loss
        self.last_step_s = step_s if self.last_step_s == 0 else 0.8 * self.last_step_s + 0.2 * step_s
        self._busy_since_heartbeat += step_s
        for p in range(len(self.fragments)):
            self.c_steps[p] += 1
            self.c_tokens[p] += tokens
        now = self.ctx.now() if now is None else now
        sent = []
        for p in due_fragments(self.step_count, len(self.fragments), self.period):
            self.send(p, now)
            sent.append(p)
        every = self.cfg.learners.save_optimizer_every
        if every and self.step_count % every == 0:
            self._queue(("optimizer", self.optimizer_state_tensors(), self.step_count))
        if not self.background_io:
            self.heartbeat(now)
        return StepReport(self.step_count, loss, tokens, submitted=sent, received=received)

    def send(self, fragment: int, now: float) -> None:
        """Hand the outer gradient of a fragment to the uploader (or upload it now, in-process)."""
        frag = self.fragments[fragment]
        with torch.no_grad():
            current = {n: self.params[n].detach().clone() for n in frag.names}
            delta = {n: self.snapshot[fragment][n] - current[n] for n in frag.names}
        with self._lock:
            tokens_new, self._tokens_unsubmitted = self._tokens_unsubmitted, 0
            carried = self._carry.pop(fragment, None)
        if carried is not None:
            delta = {n: delta[n] + carried.delta[n] for n in frag.names}
            tokens_new += carried.tokens_new
        out = Outgoing(
            fragment=fragment,
            base_version=self.base[fragment],
            delta=delta,
            c_steps=self.c_steps[fragment] + (carried.c_steps if carried else 0),
            c_tokens=self.c_tokens[fragment] + (carried.c_tokens if carried else 0),
            tokens_new=tokens_new,
            tokens_total=self.tokens_total,
            step=self.step_count,
            created_at=now,
        )
        # The next send of this fragment carries only what was learned after this one, so a
        # learner that sends twice before it hears back is never merged twice.
        self.snapshot[fragment] = current
        self.c_steps[fragment] = 0
        self.c_tokens[fragment] = 0
        if self.cfg.fragments.overlap == 0:
            self.awaiting.add(fragment)
        self._queue(out)

    def _queue(self, item) -> None:  # noqa: ANN001 - an Outgoing or an ("optimizer", tensors, step) tuple
        if self.background_io:
            self._outbox.put(item)
        elif isinstance(item, Outgoing):
            self.upload(item)
        else:
            self.save_optimizer_state(item[1], item[2])

    # --- optimizer state ------------------------------------------------------------------------

    def optimizer_state_tensors(self) -> dict[str, torch.Tensor]:
        """AdamW's per-parameter state as named tensors (safetensors, not pickle)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for p, st in self.optimizer.state.items():
            for key, value in st.items():
                if torch.is_tensor(value):
                    out[f"{names[id(p)]}::{key}"] = value.detach().clone()
        return out

    def save_optimizer_state(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        store = self.ctx.store(self.region)
        blob = store.put(learner_state_key(self.ctx.run_id, self.id, f"optim-i{self.incarnation}-s{step}"), tensors)
        with self.ctx.transaction() as s:
            old = q.set_optimizer_state(s, self.ctx.run_id, self.id, blob.key, blob.sha256)
        if old and old != blob.key:
            store.delete(old)

    def load_optimizer_state(self, key: str, sha256: str) -> bool:
        """Resume AdamW from a saved state; False (and a fresh optimizer) if it cannot be read."""
        try:
            tensors = self.ctx.store(self.region).get(key, sha256)
        except StoreError as err:
            log.warning("optimizer state %s unreadable (%s): starting AdamW afresh", key, err)
            return False
        for name, p in self.model.named_parameters():
            st = {k.split("::", 1)[1]: v for k, v in tensors.items() if k.split("::", 1)[0] == name}
            if st:
                self.optimizer.state[p] = st
        return True

    def upload(self, out: Outgoing) -> None:
        self.upload_many([out])

    def upload_many(self, outs: list[Outgoing]) -> None:
        """Write the blobs, then register them in one transaction: a row never points to a missing blob."""
        t0 = time.perf_counter()
        store = self.ctx.store(self.region)
        subs = []
        for out in outs:
            tensors, meta = encode_delta(out.delta, self.cfg.compression.codec, self.cfg.compression.block_size)
            uid = f"i{self.incarnation}-s{out.step}-f{out.fragment}"
            blob = store.put(submission_key(self.ctx.run_id, out.fragment, self.id, uid), tensors, meta)
            fault_point("learner.after_blob")
            subs.append(
                q.SubmissionIn(
                    uid=uid,
                    fragment=out.fragment,
                    base_version=out.base_version,
                    c_steps=out.c_steps,
                    c_tokens=out.c_tokens,
                    tokens_new=out.tokens_new,
                    tokens_total=out.tokens_total,
                    blob_key=blob.key,
                    sha256=blob.sha256,
                    nbytes=blob.nbytes,
                    codec=self.cfg.compression.codec,
                )
            )
        self._register(subs, self.ctx.now() if self.background_io else outs[-1].created_at)
        self.bytes_sent += sum(sub.nbytes for sub in subs)
        self.upload_s += time.perf_counter() - t0

    @ledger_retry
    def _register(self, subs: list[q.SubmissionIn], now: float) -> None:
        with self.ctx.transaction() as s:
            q.register_submissions(s, self.ctx.run_id, self.id, self.incarnation, subs, to_datetime(now))

    def _carry_over(self, outs: list[Outgoing]) -> None:
        """Keep the increments of failed uploads: the next send of their fragment includes them."""
        with self._lock:
            for out in outs:
                prev = self._carry.get(out.fragment)
                if prev is not None:
                    for n, t in prev.delta.items():
                        out.delta[n] = out.delta[n] + t
                    out.c_steps += prev.c_steps
                    out.c_tokens += prev.c_tokens
                    out.tokens_new += prev.tokens_new
                self._carry[out.fragment] = out
                self.awaiting.discard(out.fragment)

    # --- receiving ------------------------------------------------------------------------------

    def poll_versions(self) -> list[int]:
        """Download every fragment with a newer global version than the one held; returns them."""
        with self.ctx.reading() as s:
            latest = q.latest_versions(s, self.ctx.run_id)
            run = q.get_run(s, self.ctx.run_id)
        if run is not None and run.status != "running":
            self.run_finished = True
        store = self.ctx.store()
        got = []
        for p, row in sorted(latest.items()):
            if p >= len(self.fragments):
                continue
            with self._lock:
                have = max(self.base[p], self._inbox.get(p, (-1, None))[0])
            if row.version <= have:
                continue
            try:
                tensors = read_version(store, row)
            except StoreError as err:
                # A version whose blob was already collected: a newer one is published; take that next time.
                log.warning("could not read fragment %s v%s: %s", p, row.version, err)
                continue
            fault_point("learner.after_download")
            with self._lock:
                self._inbox[p] = (row.version, tensors)
                self._lock.notify_all()
            got.append(p)
        return got

    def apply_received(self) -> list[int]:
        """Swap arrived global fragments into the local model and reset the fragment's snapshot.

        ``merge.on_receipt``: overwrite (θ ← G), blend (θ ← (1 − α)·θ + α·G) — both reset the
        counters, the progress since the last send being discarded or halved — or rebase
        (θ ← θ + (G − S), S ← G): the unsent progress θ − S is carried onto the new version and
        the counters are kept, since the next send (S − θ) still carries those steps. Without
        unsent progress (c_steps 0, so θ = S: the first receipt, overlap 0) rebase is overwrite,
        exactly. Failed uploads waiting in ``_carry`` are progress already taken out of θ − S
        (as if in flight): every mode sends them with the next send, none applies them locally."""
        with self._lock:
            arrived, self._inbox = self._inbox, {}
        mode = self.cfg.merge.on_receipt
        alpha = self.cfg.merge.blend_alpha if mode == "blend" else 1.0
        with torch.no_grad():
            for p, (version, tensors) in arrived.items():
                first = self.base[p] < 0
                rebase = rebases(mode, self.base[p], self.c_steps[p])
                for n, t in tensors.items():
                    receive_tensor(self.params[n], t - self.snapshot[p][n] if rebase else t, rebase=rebase, first=first, alpha=alpha)
                self.snapshot[p] = {n: t.clone() for n, t in tensors.items()}
                self.base[p] = version
                if not rebase:
                    self.c_steps[p] = 0
                    self.c_tokens[p] = 0
                self.awaiting.discard(p)
        return sorted(arrived)

    def wait_for_awaited(self, timeout_s: float) -> bool:
        """Overlap-0 mode: block until every awaited fragment has arrived (True) or time runs out."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.awaiting and not all(p in self._inbox for p in self.awaiting) and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    # --- heartbeats and background loops -------------------------------------------------------------

    def heartbeat(self, now: float, force: bool = False) -> None:
        if not force and self._last_heartbeat is not None and now - self._last_heartbeat < self.cfg.learners.heartbeat_s:
            return
        step_s = self.last_step_s
        tps = (self.tokens_per_step() / step_s) if step_s > 0 else 0.0
        busy, self._busy_since_heartbeat = self._busy_since_heartbeat, 0.0
        with self.ctx.transaction() as s:
            q.record_heartbeat(
                s,
                self.ctx.run_id,
                self.id,
                self.incarnation,
                now=to_datetime(now),
                step=self.step_count,
                tokens=self.tokens_total,
                loss=self.last_loss,
                tokens_per_s=tps,
                step_time_s=step_s,
                busy_s=busy,
            )
        self._last_heartbeat = now

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
            finished = any(item is None for item in items)
            outs = [item for item in items if isinstance(item, Outgoing)]
            for item in items:
                if isinstance(item, tuple):
                    try:
                        self.save_optimizer_state(item[1], item[2])
                    except Exception:  # noqa: BLE001 - a missed save only costs a colder restart
                        log.exception("saving the optimizer state failed")
            if not outs:
                continue
            try:
                self.upload_many(outs)
            except Exception:  # noqa: BLE001 - the increments go out with the next send
                log.exception("upload of fragments %s failed after retries", [o.fragment for o in outs])
                self._carry_over(outs)

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_versions()
                self.heartbeat(self.ctx.now())
            except Exception:  # noqa: BLE001 - the ledger or store may be restarting; try again
                log.exception("poll failed; retrying")
            self._stop.wait(self.cfg.learners.poll_s)

    def run(self, stop: threading.Event, max_steps: int | None = None, wait_timeout_s: float = 60.0) -> None:
        """The process loop: step until stopped, the run finishes, or ``max_steps``."""
        while not stop.is_set() and not self.run_finished:
            if max_steps is not None and self.step_count >= max_steps:
                break
            report = self.step()
            if report.waiting:
                self.wait_for_awaited(min(wait_timeout_s, 1.0))
