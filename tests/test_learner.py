"""The learner on its own: rejoining, optimizer-state resume, fragment receipt."""

from __future__ import annotations

import queue
import threading

import torch
from support import sim_run
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ddiloco.inprocess import sim_learner, sim_step
from ddiloco.learner_worker.cadence import QueueState
from ddiloco.learner_worker.device import Increment
from ddiloco.learner_worker.outbox import Outbox, Outgoing
from ddiloco.learner_worker.state import is_complete
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q


def _adamw_state(learner) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in learner.model.named_parameters()}
    return {f"{names[id(p)]}::{k}": v.detach().clone() for p, st in learner.optimizer.state.items() for k, v in st.items()}


def test_restarted_learner_resumes_its_adamw_state_and_the_newest_global_version():
    cfg, clock, ctx, sync = sim_run(learners={"save_optimizer_every": 5, "regions": [{"name": "us", "learners": 1}]})
    first = sim_learner(ctx, "us-0", index=0, num_learners=1)
    first.start(clock.t)
    for _ in range(10):
        clock.t += 1.0
        sim_step(first, clock.t)
        first.finish_saves()  # states are written in the background: each save lands before the next is due
        sync.poll_once(clock.t)
    saved = _adamw_state(first)
    first.finish_saves()
    with ctx.transaction() as s:
        newest = runs_q.latest_version_numbers(s, ctx.run_id)
    assert max(newest.values()) > 0
    second = sim_learner(ctx, "us-0", index=0, num_learners=1)
    second.start(clock.t)
    assert second.incarnation == 1
    assert second.base == [newest[p] for p in range(cfg.fragments.count)]
    restored = _adamw_state(second)
    assert set(restored) == set(saved) and len(saved) > 0
    for key, value in saved.items():
        torch.testing.assert_close(restored[key], value)
    # Only the newest saved state is kept in the store: one checkpoint directory, complete.
    states = {k.rsplit("/", 1)[0] for k in ctx.store("us").list(f"{ctx.run_id}/learners/us-0")}
    assert states == {f"{ctx.run_id}/learners/us-0/i0-s10"}
    assert is_complete(f"{ctx.store('us').url}/{ctx.run_id}/learners/us-0/i0-s10")


class _GatedStager(DefaultStager):
    """DCP's stager with its copy on its own thread, held until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=False))
        self.gate = threading.Event()

    def _stage(self, state_dict, **kwargs):
        assert self.gate.wait(60), "the test never opened the gate"
        return super()._stage(state_dict, **kwargs)


def test_a_background_save_holds_its_steps_state_while_the_copy_is_still_being_made():
    cfg, clock, ctx, sync = sim_run(learners={"save_optimizer_every": 3, "regions": [{"name": "us", "learners": 1}]})
    learner = sim_learner(ctx, "us-0", index=0, num_learners=1)
    learner.start(clock.t)
    # What start_background_io does for the saves, without the link's threads (the simulated clock drives the link).
    learner._background, learner._stager = True, (stager := _GatedStager())
    for _ in range(3):
        clock.t += 1.0
        sim_step(learner, clock.t)
    at_save = _adamw_state(learner)
    params = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    # The next training step alone, on a thread: the simulation's ledger is one SQLite connection that only one thread
    # may use at a time, and DCP's thread records the save in it once written.
    done = threading.Event()
    stepping = threading.Thread(target=lambda: (learner.train_step(), done.set()))
    stepping.start()
    # The step runs its forward and backward, then waits for the copy before its optimizer step changes anything.
    stepping.join(1.0)
    assert stepping.is_alive()
    for name, p in learner.model.named_parameters():
        assert torch.equal(p.detach(), params[name]), name
    stager.gate.set()
    stepping.join(60)
    assert done.is_set()
    assert learner.finish_saves(60)
    assert any(not torch.equal(v, at_save[k]) for k, v in _adamw_state(learner).items())
    learner.stop()
    second = sim_learner(ctx, "us-0", index=0, num_learners=1)
    second.start(clock.t)
    restored = _adamw_state(second)
    assert set(restored) == set(at_save)
    for key, value in at_save.items():
        torch.testing.assert_close(restored[key], value)


def test_a_save_written_before_its_callback_is_set_is_recorded_off_the_training_thread(monkeypatch):
    """A process records its saves (a ledger transaction; the replaced state deleted from the store) on a thread of
    their own. A write that is done before its callback is added would otherwise run the record on the training
    thread, between two steps (it did, in the overhead benchmark)."""
    from concurrent.futures import Future

    from ddiloco.learner_worker import learner as learner_module

    cfg, clock, ctx, sync = sim_run(learners={"save_optimizer_every": 2, "regions": [{"name": "us", "learners": 1}]})
    learner = sim_learner(ctx, "us-0", index=0, num_learners=1)
    learner.start(clock.t)
    write = learner_module.save_state

    def written_at_once(*args, background, stager, **kwargs):
        assert background and write(*args, **kwargs) is None  # written in line: both futures are done when returned
        staged, written = Future(), Future()
        staged.set_result(None), written.set_result(None)
        return staged, written

    monkeypatch.setattr(learner_module, "save_state", written_at_once)
    record = learner.link.state_saved
    recorded_on = []
    monkeypatch.setattr(learner.link, "state_saved", lambda url: (recorded_on.append(threading.current_thread()), record(url)))
    # start_background_io's saves, without the link's threads (the simulated clock drives the link).
    learner._background = True
    learner._recorder = learner_module.ThreadPoolExecutor(max_workers=1, thread_name_prefix="us-0-state")
    for _ in range(4):
        # The simulation's ledger is one SQLite connection, for one thread at a time: the recorder waits for the step.
        step_done = threading.Event()
        learner._recorder.submit(step_done.wait, 60)
        clock.t += 1.0
        sim_step(learner, clock.t)
        step_done.set()
        assert learner.finish_saves(60)
    assert len(recorded_on) == 2 and all(t.name.startswith("us-0-state") for t in recorded_on), recorded_on
    with ctx.transaction() as s:
        row = runs_q.learners(s, ctx.run_id)[0]
    assert row.optimizer_state_key and row.optimizer_state_key.endswith("-s4")
    learner.stop()
    assert learner._recorder is None


def test_late_joiner_starts_from_the_newest_global_state():
    cfg, clock, ctx, sync = sim_run()
    early = sim_learner(ctx, "us-0", index=0, num_learners=2)
    early.start(clock.t)
    for _ in range(2 * cfg.fragments.count):
        clock.t += 1.0
        sim_step(early, clock.t)
        sync.poll_once(clock.t)
    late = sim_learner(ctx, "us-1", index=1, num_learners=2)
    late.start(clock.t)
    global_params = dict(sync.global_model().named_parameters())
    for name, p in late.model.named_parameters():
        torch.testing.assert_close(p.detach(), global_params[name].detach())
    assert min(late.base) > 0


def test_blend_on_receipt_moves_halfway():
    cfg, clock, ctx, sync = sim_run(merge={"on_receipt": "blend", "blend_alpha": 0.5})
    learner = sim_learner(ctx, "us-0", index=0, num_learners=1)
    learner.start(clock.t)
    name = next(iter(learner.fragments[0].tensors))
    local = learner.fragments[0].tensors[name].detach().clone()
    incoming = {n: torch.zeros_like(t) for n, t in learner.fragments[0].tensors.items()}
    _arrive(learner, 0, incoming)
    torch.testing.assert_close(learner.fragments[0].tensors[name].detach(), 0.5 * local)
    assert learner.fragments[0].c_steps == 0 and torch.equal(learner.fragments[0].snapshot_tensors()[name], incoming[name])


def _arrive(learner, p, tensors):
    """A newer global version of fragment p arrives and the next step applies it."""
    learner.link.downloader._inbox[p] = (learner.base[p] + 1, tensors)
    learner._receive(learner._agree(want_stop=False))


def test_rebase_on_receipt_carries_the_unsent_progress_onto_the_new_version():
    cfg, clock, ctx, sync = sim_run(merge={"on_receipt": "rebase"})
    learner = sim_learner(ctx, "us-0", index=0, num_learners=1)
    learner.start(clock.t)
    for _ in range(cfg.fragments.period + 2):
        clock.t += 1.0
        learner.step(clock.t)
    p = max(range(len(learner.fragments)), key=lambda i: learner.fragments[i].c_steps)
    frag = learner.fragments[p]
    views = frag.tensors
    names = list(views)
    steps, tokens = frag.c_steps, frag.c_tokens
    assert steps > 0
    unsent = {n: views[n].detach() - frag.snapshot_tensors()[n] for n in names}
    assert max(float(u.abs().max()) for u in unsent.values()) > 0
    incoming = {n: torch.randn_like(views[n]) for n in names}
    _arrive(learner, p, incoming)
    for n in names:
        # What the next send (snapshot - params) carries is the progress it would have carried before.
        torch.testing.assert_close(views[n].detach() - frag.snapshot_tensors()[n], unsent[n])
        torch.testing.assert_close(views[n].detach(), incoming[n] + unsent[n])
        assert torch.equal(frag.snapshot_tensors()[n], incoming[n])
    # Those steps are still unsent, so they are still counted.
    assert (frag.c_steps, frag.c_tokens) == (steps, tokens)

    # Without unsent progress (a fragment just sent) rebase is overwrite, bit for bit.
    report = learner.step(clock.t + 1.0)
    while not report.submitted:
        report = learner.step(clock.t + 1.0)
    q_ = report.submitted[0]
    assert learner.fragments[q_].c_steps == 0
    incoming = {n: torch.randn_like(t) for n, t in learner.fragments[q_].tensors.items()}
    _arrive(learner, q_, incoming)
    for n, t in incoming.items():
        assert torch.equal(learner.fragments[q_].tensors[n].detach(), t)
    assert learner.fragments[q_].c_steps == 0 and learner.fragments[q_].c_tokens == 0


def test_overwrite_on_receipt_discards_the_unsent_progress():
    cfg, clock, ctx, sync = sim_run(merge={"on_receipt": "overwrite"})
    learner = sim_learner(ctx, "us-0", index=0, num_learners=1)
    learner.start(clock.t)
    for _ in range(2):
        clock.t += 1.0
        learner.step(clock.t)
    p = max(range(len(learner.fragments)), key=lambda i: learner.fragments[i].c_steps)
    incoming = {n: torch.randn_like(t) for n, t in learner.fragments[p].tensors.items()}
    _arrive(learner, p, incoming)
    for n, t in incoming.items():
        assert torch.equal(learner.fragments[p].tensors[n].detach(), t)
    assert learner.fragments[p].c_steps == 0 and learner.fragments[p].c_tokens == 0


def test_a_slow_link_queues_one_blob_per_fragment_and_loses_no_token():
    """Uploads that do not keep pace: newer increments of a fragment join the one already queued
    (counts and tokens summed), so the queue stays at one blob per fragment and nothing is lost."""
    import torch

    from ddiloco.platform.compression import decode_delta
    from ddiloco.platform.ledger.models import Submission
    from ddiloco.platform.store import FragmentStore

    # A fixed cadence: an adaptive learner would answer the backlog with a cheaper codec and a longer period.
    cfg, clock, ctx, sync = sim_run(learners={"regions": [{"name": "us", "learners": 1}]}, fragments={"count": 4, "adaptive": False})
    learner = sim_learner(ctx, "us-0")
    learner.start(clock.t)
    P = cfg.fragments.count
    before = {p: {n: t.detach().clone() for n, t in f.tensors.items()} for p, f in enumerate(learner.fragments)}
    for _ in range(3 * P):  # every fragment sent three times, nothing uploaded (the link is down)
        clock.t += 1.0
        learner.link.poll()
        learner.step(clock.t)
    outbox = learner.link.outbox
    assert outbox.qsize() == P and outbox.coalesced == 2 * P
    # Each waiting blob keeps one increment however many sends it took in: its memory does not grow with the stall.
    assert all(len(out.parts) == 1 for out in outbox.queued())
    assert outbox.oldest_unsent_s(clock.t) == 3 * P - 1  # the first send, 3P - 1 steps ago
    learner.link.uploader.pump()
    assert outbox.oldest_unsent_s(clock.t) == 0.0
    with ctx.reading() as s:
        rows = s.query(Submission).filter(Submission.learner_id == "us-0").all()
        acct = reports_q.token_accounting(s, ctx.run_id)
    assert len(rows) == P
    assert sum(r.tokens_new for r in rows) == learner.tokens_total == acct.pending  # every token in the accounting
    store = FragmentStore(cfg.storage.url)
    H = cfg.fragments.period
    for r in rows:
        # Its steps: from joining to its last send (fragment p goes out after steps p, p + H, ...).
        assert r.c_steps == max(step for step in range(1, 3 * P + 1) if (step - r.fragment) % H == 0)
    # Fragment 0 went out at the last step: its one blob is everything it learned, the increments summed.
    r0 = next(r for r in rows if r.fragment == 0)
    got = decode_delta(*store.get_with_metadata(r0.blob_key, r0.sha256, r0.nbytes))
    for n, t in learner.fragments[0].tensors.items():
        assert torch.allclose(got[n].float(), before[0][n] - t.detach(), atol=1e-5), n


class _SideBySideIO:
    """A link's I/O whose blob writes each wait at a barrier for ``n`` writes to be under way: writes made one after the
    other break it (BrokenBarrierError after the timeout) instead of passing."""

    def __init__(self, io, n: int) -> None:
        self.io, self.barrier, self.threads = io, threading.Barrier(n, timeout=60), set()

    def put_blob(self, region, key, data):
        self.threads.add(threading.get_ident())  # all alive at once at the barrier, so all distinct
        self.barrier.wait()
        return self.io.put_blob(region, key, data)

    def __getattr__(self, name):
        return getattr(self.io, name)


def test_the_upload_thread_writes_queued_blobs_side_by_side_and_registers_them_all():
    """Four fragments queued behind an upload are written at once (a long path's round trips overlap), then registered
    in one exchange; the link's meter counts the four as one transfer of their bytes."""
    from ddiloco.learner_worker.uploader import UPLOAD_BATCH, WRITE_AT_ONCE
    from ddiloco.platform.ledger.models import Submission

    cfg, clock, ctx, sync = sim_run(learners={"regions": [{"name": "us", "learners": 1}]},
                                    fragments={"count": WRITE_AT_ONCE, "adaptive": False})
    learner = sim_learner(ctx, "us-0")
    learner.start(clock.t)
    for _ in range(WRITE_AT_ONCE):  # every fragment sent once, nothing uploaded yet
        clock.t += 1.0
        learner.step(clock.t)
    uploader = learner.link.uploader
    io = uploader.io = _SideBySideIO(uploader.io, WRITE_AT_ONCE)
    done = learner.link.meter._done["up"]
    before = len(done.items)
    assert not uploader.handle(uploader.outbox.take(UPLOAD_BATCH), at_once=WRITE_AT_ONCE)
    assert len(io.threads) == WRITE_AT_ONCE and io.barrier.n_waiting == 0 and not io.barrier.broken
    with ctx.reading() as s:
        rows = s.query(Submission).filter(Submission.learner_id == "us-0").all()
    assert sorted(r.fragment for r in rows) == list(range(WRITE_AT_ONCE))
    (transfer,) = list(done.items)[before:]
    assert transfer.nbytes == sum(r.nbytes for r in rows) == uploader.bytes_sent


def test_a_fragment_waiting_through_failed_uploads_keeps_one_increment_equal_to_the_sum():
    """Sends queued behind a stalled upload and increments of failed uploads are summed as they meet, oldest
    first, so a fragment waits with one increment (not one per send) and its blob is the bytes the sum would give."""
    g = torch.Generator().manual_seed(0)
    increments = [{"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)} for _ in range(7)]
    outbox = Outbox()

    def send(i: int) -> Outgoing:
        return Outgoing(0, 0, [Increment(dict(increments[i]))], 1, 8, 8, 8 * (i + 1), i, created_at=float(i))

    outbox.submit(send(0))
    outbox.submit(send(1))  # coalesced into the waiting one
    (taken,) = outbox.take()
    outbox.carry_over([taken])  # its upload failed
    outbox.submit(send(2))  # carries the failed one
    outbox.submit(send(3))
    (taken,) = outbox.take()
    outbox.carry_over([taken])
    for i in range(4, 7):
        outbox.submit(send(i))
    (waiting,) = outbox.queued()
    assert len(waiting.parts) == 1 and (waiting.c_steps, waiting.c_tokens, waiting.tokens_new) == (7, 56, 56)
    for name in ("w", "b"):
        expected = increments[0][name]
        for inc in increments[1:]:
            expected = expected + inc[name]
        assert torch.equal(waiting.delta()[name], expected), name
    # The sum made new tensors: the increments handed over are left as they were.
    assert not any(waiting.delta()[n].data_ptr() == inc[n].data_ptr() for inc in increments for n in inc)


def test_the_outbox_ages_its_oldest_waiting_send_when_sends_are_taken_and_queued_again():
    outbox = Outbox()

    def send(fragment: int, at: float) -> Outgoing:
        return Outgoing(fragment, 0, [], 1, 8, 8, 8, 1, created_at=at)

    outbox.submit(send(0, 1.0))
    outbox.submit(send(1, 2.0))
    outbox.submit(send(0, 3.0))  # coalesced into the waiting send of fragment 0: it keeps its age
    assert outbox.queue_state(10.0) == QueueState(2, 9.0)
    assert [item.fragment for item in outbox.take()] == [0]
    assert outbox.queue_state(10.0) == QueueState(1, 8.0)
    outbox.submit(send(0, 4.0))  # queued anew, behind fragment 1
    assert outbox.queue_state(10.0) == QueueState(2, 8.0)
    assert [item.fragment for item in outbox.take(2)] == [1, 0]
    assert outbox.queue_state(10.0) == QueueState(0, 0.0)


class _WatchedQueue(queue.Queue):
    """The outbox's queue, telling when its taker waits idle for a first item and when it lingers for more."""

    def __init__(self) -> None:
        super().__init__()
        self.idle = threading.Event()
        self.lingering = threading.Event()

    def get(self, block: bool = True, timeout: float | None = None):
        if block and timeout is None:
            self.idle.set()
        elif block:
            self.lingering.set()
        return super().get(block, timeout)


def _send(fragment: int) -> Outgoing:
    return Outgoing(fragment, 0, [], 1, 8, 8, 8, 1, created_at=0.0)


def _take_in_thread(outbox: Outbox, most: int, linger_s: float) -> tuple[threading.Thread, list]:
    got: list = []
    taker = threading.Thread(target=lambda: got.extend(outbox.take(most, wait=True, linger_s=linger_s)), daemon=True)
    taker.start()
    return taker, got


def test_an_idle_upload_lingers_for_more_sends_and_a_backlog_or_the_stop_marker_is_not_held_back():
    # Idle: the first send is not taken alone; the taker waits for more, up to the batch's size.
    outbox = Outbox()
    outbox._queue = watched = _WatchedQueue()
    taker, got = _take_in_thread(outbox, 4, linger_s=60.0)
    assert watched.idle.wait(10)
    outbox.submit(_send(0))
    assert watched.lingering.wait(10), "the taker returned the first send alone"
    for p in (1, 2, 3):
        outbox.submit(_send(p))
    taker.join(10)
    assert not taker.is_alive() and [o.fragment for o in got] == [0, 1, 2, 3]
    assert outbox.queue_state(1.0).depth == 0
    # The stop marker ends a linger at once, with what was taken.
    outbox._queue = watched = _WatchedQueue()
    taker, got = _take_in_thread(outbox, 4, linger_s=60.0)
    assert watched.idle.wait(10)
    outbox.submit(_send(5))
    assert watched.lingering.wait(10)
    outbox.close()
    taker.join(10)
    assert not taker.is_alive() and got[0].fragment == 5 and got[1:] == [None]
    # A backlog (the upload was busy) is taken as it is, with no wait for more.
    outbox._queue = watched = _WatchedQueue()
    outbox.submit(_send(6))
    outbox.submit(_send(7))
    assert [o.fragment for o in outbox.take(4, wait=True, linger_s=60.0)] == [6, 7]
    assert not watched.idle.is_set() and not watched.lingering.is_set()


def test_the_upload_linger_is_the_configs_and_none_with_overlap_0():
    for fragments, linger in (({}, 0.02), ({"overlap": 0}, 0.0)):
        _cfg, _clock, ctx, _sync = sim_run(fragments=fragments)
        assert sim_learner(ctx, "us-0").link.uploader.linger_s == linger
        ctx.engine.dispose()
    _cfg, _clock, ctx, _sync = sim_run(learners={"upload_linger_s": 0.1})
    assert sim_learner(ctx, "us-0").link.uploader.linger_s == 0.1
    ctx.engine.dispose()


def test_a_learners_spans_mark_its_steps_in_a_torch_profiler_trace_and_count_without_one():
    from ddiloco.platform import spans

    cfg, clock, ctx, sync = sim_run(learners={"regions": [{"name": "us", "learners": 1}]})
    learner = sim_learner(ctx, "us-0", index=0, num_learners=1)
    learner.start(clock.t)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        clock.t += 1.0
        sim_step(learner, clock.t)
    names = {e.name for e in prof.events()}
    assert {"learner.train_step", "learner.agree", "learner.send"} <= names, sorted(n for n in names if "." in n)
    with spans.collecting() as totals:
        clock.t += 1.0
        sim_step(learner, clock.t)
    assert totals["learner.train_step.calls"] == 1 and totals["learner.train_step"] > 0
