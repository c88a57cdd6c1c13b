"""The link's I/O in a process of its own (``learners.link_process``): the same answers as in the learner's process
(blobs, exchanges, versions decoded from their compact form), the same errors, a child that dies is started again, and
none outlives its learner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from support import tiny_config, wait_for

from ddiloco.learner_worker.learner import Learner
from ddiloco.learner_worker.link import LearnerLink
from ddiloco.learner_worker.linkio import IOProcess, LocalIO
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger.models import Learner as LearnerRow
from ddiloco.platform.ledger.models import Submission
from ddiloco.platform.run_state import build_layout, register_run
from ddiloco.platform.runtime import RunContext
from ddiloco.platform.store import BlobCorruptError, BlobMissingError, encode_tensors
from ddiloco.synchronizer.service import Synchronizer


def _run(tmp_path, **learners):  # noqa: ANN001, ANN202
    cfg = tiny_config(
        name="linkio",
        learners={"regions": [{"name": "us", "learners": 1}], "heartbeat_s": 0.5, "poll_s": 0.1, **learners},
        synchronizer={"poll_s": 0.05, "eval_every_s": 1000.0},
        quorum={"min_count": 1}, grace={"enabled": False}, compression={"codec": "int8"},
        ledger={"url": f"sqlite:///{tmp_path / 'ledger.db'}"}, storage={"url": f"file://{tmp_path / 'store'}"},
    )
    ctx = RunContext.open(cfg)
    register_run(ctx, build_layout(ctx))
    Synchronizer(ctx, holder="sync").poll_once(ctx.now())  # version 0 of every fragment
    return cfg, ctx


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_io_process_answers_as_the_learners_own_io_and_is_started_again_when_it_dies(tmp_path):
    cfg, ctx = _run(tmp_path)
    local, remote = LocalIO(ctx), IOProcess(ctx)
    try:
        assert remote.pid != os.getpid() and _alive(remote.pid)
        data = encode_tensors({"w": torch.arange(6, dtype=torch.float32)}, {"codec": "none"})
        blob = remote.put_blob("us", "linkio/x/blob-1", data)
        assert blob == local.put_blob("us", "linkio/x/blob-1", data), "the same bytes again are no error, either way"
        assert local.get_blob(blob.key, blob.sha256, blob.nbytes) == remote.get_blob(blob.key, blob.sha256, blob.nbytes) == data
        with pytest.raises(BlobMissingError, match="is missing"):
            remote.get_blob("linkio/x/nothing", None, None)
        with pytest.raises(BlobCorruptError, match="does not match its sha256"):
            remote.get_blob(blob.key, "0" * 64, blob.nbytes)

        link = LearnerLink(ctx, "us-0", "us")
        link.configure(cfg.fragments.count, None)
        link.join(ctx.now())
        sub = learner_q.SubmissionIn("i0-s1-f0", 0, 0, 1, 128, 128, 128, blob.key, blob.sha256, blob.nbytes, "none", data_batches=1)
        beat = learner_q.Beat(1, 128, 2.5, 1000.0, 0.1, 0.1, history=True, queue_depth=0, oldest_unsent_s=0.0,
                              model_flops_per_s=2.0e9, mfu=None)
        now, ex = remote.exchange("us-0", 0, [sub], beat, [("link_cadence", "a test event")], {})
        assert abs(now - time.time()) < 60 and ex.current and ex.run_status == "running"
        with ctx.reading() as s:  # the beat crossed to the child whole
            row = s.get(LearnerRow, (ctx.run_id, "us-0"))
            assert (row.model_flops_per_s, row.mfu) == (2.0e9, None)
        assert len(ex.registered) == 1 and ex.registered[0][1] is True
        assert sorted(ex.heads) == list(range(cfg.fragments.count)) and all(h.version == 0 for h in ex.heads.values())
        # A version fetched through the child comes back as the learner's own I/O reads it.
        head = ex.heads[1]
        (mine, n_mine, c_mine), (theirs, n_theirs, c_theirs) = local.fetch(head, None), remote.fetch(head, None)
        assert (n_mine, c_mine) == (n_theirs, c_theirs) and mine.keys() == theirs.keys() and mine
        assert all(torch.equal(mine[k], theirs[k]) and theirs[k].dtype == torch.float32 for k in mine)
        # Asked again with the heads it knows, the answer is the learner's own I/O's: a repeat, and nothing newer.
        known = {f: h.version for f, h in ex.heads.items()}
        assert remote.exchange("us-0", 0, [sub], beat, [], known)[1] == local.exchange("us-0", 0, [sub], beat, [], known)[1]
        with ctx.reading() as s:
            assert s.query(Submission).filter_by(uid="i0-s1-f0").count() == 1
        # What the child is sent is checked there as in the learner: a request with implausible counts is refused.
        with pytest.raises(ValueError, match="implausible counts"):
            remote._call({"op": "exchange", "learner_id": "us-0", "incarnation": 0, "beat": None, "events": [], "known": {},
                          "subs": [{**sub.__dict__, "uid": "bad", "c_steps": 0}]})

        first = remote.pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: not _alive(first), 10, "the I/O process to die")
        assert remote.get_blob(blob.key, blob.sha256, blob.nbytes) == data, "a dead child is started again"
        assert remote.starts == 2 and remote.pid != first and _alive(remote.pid)
    finally:
        child = remote.pid
        remote.close()
    assert not _alive(child)


def test_the_io_process_ends_with_its_learner_when_the_learner_is_sigkilled(tmp_path):
    _run(tmp_path)
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from support import tiny_config
        from ddiloco.learner_worker.linkio import IOProcess
        from ddiloco.platform.runtime import RunContext
        cfg = tiny_config(name="linkio", ledger={{"url": "sqlite:///{tmp_path / 'ledger.db'}"}},
                          storage={{"url": "file://{tmp_path / 'store'}"}})
        print(IOProcess(RunContext.open(cfg)).pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    child = int(out.stdout.split()[0])
    wait_for(lambda: not _alive(child), 20, "the I/O process of a SIGKILLed learner to end")


def _recording(fetch, fetched: list[tuple[int, int]]):  # noqa: ANN001, ANN202
    """``fetch`` noting (bytes fetched, the version's float32 size) of each version."""

    def recorded(row, prefer):  # noqa: ANN001, ANN202
        tensors, nbytes, codec = fetch(row, prefer)
        fetched.append((nbytes, row.nbytes))
        return tensors, nbytes, codec

    return recorded


def test_a_learner_with_its_io_in_a_process_of_its_own_sends_receives_and_accounts_for_every_token(tmp_path):
    cfg, ctx = _run(tmp_path, link_process=True)
    stop = threading.Event()
    sync = threading.Thread(target=Synchronizer(ctx, holder="sync").run, args=(stop,), daemon=True)
    fetched: list[tuple[int, int]] = []
    try:
        sync.start()
        for incarnation in range(2):
            link = LearnerLink(ctx, "us-0", "us")
            learner = Learner(cfg, "us-0", index=0, num_learners=1, link=link, clock=ctx.now)
            try:
                learner.start()
                held = dict(link.downloader.io.bases)
                learner.start_background_io()
                assert isinstance(link.io, IOProcess) and link.uploader.io is link.io and link.downloader.io is link.io
                child = link.io.pid
                assert _alive(child)
                if incarnation == 1:
                    # Rejoined, it holds compact bases (taken in the learner's process before the threads start).
                    assert len(held) == cfg.fragments.count
                    link.io.fetch = _recording(link.io.fetch, fetched)
                downloads = link.downloader
                # Rejoined, its fetches are counted from the wrap on: a download can land between the threads' start and it.
                learner.run(lambda: downloads.downloads >= cfg.fragments.count + 6 and (incarnation == 0 or len(fetched) >= 6),  # noqa: B023
                            max_steps=400)
            finally:
                learner.stop()
            assert not _alive(child) and isinstance(link.io, LocalIO), "the I/O process ends with the link"
            assert link.downloader.downloads >= cfg.fragments.count + 6, "merged versions came back through the I/O process"
            assert link.downloader.delta_codecs.get("int8", 0) > 0, "as compact downloads, decoded in the I/O process"
    finally:
        stop.set()
        sync.join(timeout=30)
    # The child was given the bases the learner held: no download through it fetched a float32 base again.
    assert len(fetched) >= 6 and all(nbytes < whole for nbytes, whole in fetched), fetched
    with ctx.reading() as s:
        subs = s.query(Submission).filter_by(run_id="linkio", learner_id="us-0").all()
        # Every row is a send of the learner's (the I/O process's warm-up registration was rolled back), and none is
        # rejected: not even one that a stall of the test's own synchronizer thread made coalesce many steps.
        assert len(subs) >= 12 and all(sub.uid[:3] in ("i0-", "i1-") and sub.sha256 and sub.nbytes > 0 for sub in subs)
        assert any(sub.status == "merged" for sub in subs)
        assert [(sub.c_steps, sub.reject_reason) for sub in subs if sub.status == "rejected"] == []
        assert reports_q.token_accounting(s, "linkio").balanced
