"""A learner as a data-parallel job: DDP ranks (gloo here), rank 0 the learner's only voice.

- device handling (CPU paths run here; CUDA paths skip, saying why);
- only rank 0 has a link to the run (the ledger and the store);
- a 2-rank gloo learner equals a 1-rank learner with twice the batch on the same data, through sends,
  merges and receipts (parameters of both ranks, submissions, published versions);
- SIGKILL of one rank of a 2-rank ``ddiloco learner --nproc-per-node 2`` job: the job ends within a
  bounded time, its submissions stay whole in the ledger, and a relaunch rejoins and finishes cleanly.

This file is also the rank program of the equivalence test: ``python tests/test_ddp_learner.py rank DIR RANK WORLD``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from sqlalchemy import select
from support import ProcessRun, run_ranks, tiny_config, wait_for

from ddiloco.entry import ProcessSpec
from ddiloco.inprocess import SimClock, sim_learner
from ddiloco.learner_worker.device import (
    Increment,
    LateRead,
    autocast,
    backend_for,
    resolve_device,
)
from ddiloco.learner_worker.dist import Dist, init_dist, shutdown_dist
from ddiloco.learner_worker.launch import torchrun_command
from ddiloco.learner_worker.learner import Learner
from ddiloco.learner_worker.link import LearnerLink
from ddiloco.learner_worker.parallel import blocks
from ddiloco.platform.config import ConfigError, build_config
from ddiloco.platform.data import Batch
from ddiloco.platform.ledger import open_ledger
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.models import FragmentVersion, Submission
from ddiloco.platform.ledger.models import Learner as LearnerRow
from ddiloco.platform.models.cost import state_bytes_per_rank
from ddiloco.platform.runtime import RunContext
from ddiloco.platform.store import FragmentStore
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.testing.processes import ProcessCluster

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False on this machine): the CPU fallback is tested instead"
B = 4  # per-rank batch
STEPS = 6  # inner steps: with 4 fragments sent one a step and merged at once, three or more are received back


# --- device handling -----------------------------------------------------------------------------------


def test_auto_device_is_the_cpu_without_cuda_and_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu", local_rank=3) == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ConfigError):
        resolve_device("tpu")
    assert backend_for(torch.device("cpu")) == "gloo"


def test_auto_device_gives_each_local_rank_its_own_gpu_and_refuses_a_rank_without_one(monkeypatch):
    # Only the choice is exercised (no kernel runs): a pod with 2 GPUs (what its nvidia.com/gpu gives, numbered
    # from 0) and 2 ranks; a third rank would share a GPU, which is refused rather than left to NCCL or OOM.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [resolve_device("auto", local_rank=r) for r in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert resolve_device("cpu", local_rank=1) == torch.device("cpu")
    assert backend_for(resolve_device("cuda", local_rank=1)) == "nccl"
    with pytest.raises(ConfigError, match="local rank 2 has no GPU of its own: torch sees 2"):
        resolve_device("auto", local_rank=2)


def test_cpu_autocast_keeps_full_precision():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with autocast(torch.device("cpu")):
        out = a @ b
    assert out.dtype == torch.float32 and torch.equal(out, a @ b)


def test_a_cpu_send_is_an_increment_computed_in_place_with_nothing_staged(tmp_path):
    """A CPU learner's send: the increment is ready (no event, no stream), encoded where it is."""
    inc = Increment({"w": torch.arange(6, dtype=torch.float32)})
    assert inc.resolve()["w"] is inc.tensors["w"]
    with inc.stream_context():
        assert torch.equal(inc.resolve()["w"], torch.arange(6, dtype=torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_increment_is_encoded_on_a_side_stream_after_the_training_stream():
    from ddiloco.platform.compression import encode_delta

    device = torch.device("cuda", 0)
    side = torch.cuda.Stream(device=device)
    x = torch.randn(1 << 22, device=device)
    inc_t = x * 3.0  # queued on the training stream
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    inc = Increment({"w": inc_t}, event, side)
    # Both quantizing codecs: a scale divided on the device by a host number is a multiplication by its reciprocal
    # there, one bit off for ~5% of int8 blocks and ~half of int4's, and then codes differ from the CPU's.
    for codec, dtype in (("int8", torch.int8), ("int4", torch.uint8)):
        with inc.stream_context():
            assert torch.cuda.current_stream(device) == side
            tensors, meta = encode_delta(inc.resolve(), codec, 64)
        assert tensors["w::q"].device.type == "cpu" and tensors["w::q"].dtype == dtype
        ref, ref_meta = encode_delta({"w": (x * 3.0).cpu()}, codec, 64)
        assert meta == ref_meta and all(torch.equal(tensors[k], ref[k]) for k in ref), codec
    # A fragment of several tensors: quantized on the GPU as one buffer where no block straddles two of them (the
    # first), a tensor at a time where one would (the second); the CPU's bytes either way.
    g = torch.Generator(device=device).manual_seed(0)
    for sizes in ((64 * 300, 64 * 7, 1000 + 3), (64 * 300, 1000 + 3, 64 * 7)):
        frag = {f"t{i}": torch.randn(n, device=device, generator=g) for i, n in enumerate(sizes)}
        for codec in ("int8", "int4"):
            tensors, meta = encode_delta(frag, codec, 64)
            ref, ref_meta = encode_delta({k: v.cpu() for k, v in frag.items()}, codec, 64)
            assert meta == ref_meta and tensors.keys() == ref.keys(), (sizes, codec)
            assert all(torch.equal(tensors[k], ref[k]) for k in ref), (sizes, codec)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_increments_folded_on_the_training_stream_are_encoded_after_the_sum():
    """Sends coalesced behind a stalled upload are summed on the training stream, with an event after the sum that
    the side stream waits on: the encoded bytes are those of the sum, made on the CPU."""
    from ddiloco.learner_worker.device import fold_increments
    from ddiloco.platform.compression import encode_delta

    device = torch.device("cuda", 0)
    side = torch.cuda.Stream(device=device)
    xs = [torch.randn(1 << 22, device=device, generator=torch.Generator(device=device).manual_seed(i)) for i in range(3)]
    parts = []
    for x in xs:
        t = x * 2.0  # queued on the training stream
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        parts.append(Increment({"w": t}, event, side))
    folded = fold_increments(parts)
    assert isinstance(folded, Increment) and folded.stream is side and folded.ready is not None
    with folded.stream_context():
        tensors, meta = encode_delta(folded.resolve(), "int8", 64)
    ref, ref_meta = encode_delta({"w": ((xs[0] * 2.0 + xs[1] * 2.0) + xs[2] * 2.0).cpu()}, "int8", 64)
    assert meta == ref_meta and all(torch.equal(tensors[k], ref[k]) for k in ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_a_late_read_on_cuda_gives_each_value_at_the_next_put():
    late = LateRead(late=True)
    x = torch.randn(2048, 2048, device="cuda")
    got = []
    for k in range(1, 4):
        y = (x @ x).sum() * 0.0 + k  # the value is ready only once the matmul queued before it is done
        got.append(late.put(y.double()))
    assert got == [None, 1.0, 2.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_autocast_is_bf16():
    a = torch.randn(8, 8, device="cuda")
    with autocast(torch.device("cuda", 0)):
        assert (a @ a).dtype == torch.bfloat16


def test_only_rank_0_has_a_link_to_the_run():
    cfg = tiny_config()
    ctx = RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(cfg.ledger.url))
    other_rank = Dist(rank=1, world=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="only rank 0"):
        Learner(cfg, "us-0", index=0, num_learners=1, link=LearnerLink(ctx, "us-0", "us"), dist=other_rank)
    with pytest.raises(ValueError, match="rank 0 of a learner needs a link"):
        Learner(cfg, "us-0", index=0, num_learners=1, link=None)


def test_the_launch_is_plain_torchrun_with_no_restarts():
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(torchrun_command(2, "/c.yaml", "r1", "us-0", max_steps=5, summary_path="/s.json"))
    assert args.nproc_per_node == "2" and args.max_restarts == 0 and args.standalone and args.module
    assert args.training_script == "ddiloco"
    assert args.training_script_args == [
        "learner",
        "--config",
        "/c.yaml",
        "--run-id",
        "r1",
        "--learner",
        "us-0",
        "--max-steps",
        "5",
        "--summary-json",
        "/s.json",
    ]


# --- driving a learner on the simulated clock ----------------------------------------------------------


def _drive(learner, sync, clock, steps: int, other=None) -> list[float]:
    """Every rank steps; rank 0 also fetches, uploads what it sent and lets the synchronizer merge (``other``: a
    second learner of the run, stepped in lockstep by rank 0)."""
    losses = []
    for _ in range(steps):
        clock.t += 1.0
        if learner.link is not None:
            learner.link.poll()
            if other is not None:
                other.link.poll()
                other.step(clock.t)
                other.link.uploader.pump()
        report = learner.step(clock.t)
        losses.append(report.loss)
        if learner.link is not None:
            learner.link.uploader.pump()
            sync.poll_once(clock.t)
    return losses


def one_learner_config(**extra):
    return tiny_config(learners={"batch_size": B, "regions": [{"name": "us", "learners": 1}]}, **extra)


# --- two gloo ranks == one rank with twice the batch ------------------------------------------------------


def _concat(*streams):
    while True:
        parts = [next(s) for s in streams]
        yield Batch(
            inputs=torch.cat([b.inputs for b in parts]),
            targets=torch.cat([b.targets for b in parts]),
            tokens=sum(b.tokens for b in parts),
        )


def _open_run(workdir: Path, cfg):
    cfg = cfg.model_copy(
        update={
            "ledger": cfg.ledger.model_copy(update={"url": f"sqlite:///{workdir / 'ledger.db'}"}),
            "storage": cfg.storage.model_copy(update={"url": f"file://{workdir / 'store'}"}),
        }
    )
    clock = SimClock()
    ctx = RunContext.open(cfg, cfg.name, clock=clock)
    sync = Synchronizer(ctx, holder="sync")
    sync.poll_once(clock.t)
    return cfg, clock, ctx, sync


def _ledger_view(ctx) -> dict:
    with ctx.transaction() as s:
        subs = s.execute(
            select(
                Submission.uid,
                Submission.fragment,
                Submission.base_version,
                Submission.c_steps,
                Submission.c_tokens,
                Submission.tokens_new,
                Submission.status,
                Submission.merged_version,
                Submission.learner_id,
            ).order_by(Submission.id)
        ).all()
        versions = sorted(s.execute(select(FragmentVersion.fragment, FragmentVersion.version)).all())
        worlds = dict(s.execute(select(LearnerRow.id, LearnerRow.world_size)).all())
    return {"submissions": [list(r) for r in subs], "versions": [list(v) for v in versions], "world_sizes": worlds}


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter whole: an FSDP shard's DTensor gathered, a plain tensor as it is."""
    full = getattr(p, "full_tensor", None)
    return (full() if callable(full) else p).detach().contiguous()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: an FSDP DTensor's local shard, a plain tensor as it is."""
    local = getattr(t, "to_local", None)
    return local() if callable(local) else t


def rank_main(workdir: Path, rank: int, world: int) -> None:
    """One rank of a 2-rank learner us-0: rank 0 in the test process, rank 1 a subprocess. When the config
    lists a second learner, rank 0 also steps us-1, a one-process learner of the same run, in lockstep."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = build_config(yaml.safe_load((workdir / "config.yaml").read_text()))
    d = init_dist(
        torch.device("cpu"), timeout_s=60, ready_timeout_s=60, init_method=f"file://{workdir / 'pg'}", rank=rank, world=world
    )
    try:
        other = None
        if rank == 0:
            cfg, clock, ctx, sync = _open_run(workdir, cfg)
            link = LearnerLink(ctx, "us-0", "us")
            if cfg.learners.count > 1:
                other = sim_learner(ctx, "us-1", index=1, num_learners=cfg.learners.count)
        else:
            clock, ctx, sync, link = SimClock(), None, None, None
        learner = Learner(cfg, "us-0", index=0, num_learners=cfg.learners.count, link=link, dist=d, clock=clock)
        if (workdir / LATE_LOSS).exists():
            learner.loss_read = LateRead(late=True)  # as on a GPU: each step's loss read one step late
        learner.start(clock.t)
        if other is not None:
            other.start(clock.t)
        losses = _drive(learner, sync, clock, STEPS, other)
        params = {n: _full(p) for n, p in learner.model.named_parameters()}
        save_file(params, str(workdir / f"params-{rank}.safetensors"))
        out = {
            "losses": losses, "base": learner.base, "tokens_total": learner.tokens_total,
            "shards": learner.layout.shards,
            "local_numel": sum(v.numel() for f in learner.fragments for v in f.views),
            "numel": sum(p.numel() for p in params.values()),
            "checkpointed_blocks": learner.checkpointed_blocks,
            "block_classes": [type(b).__name__ for b in blocks(learner.model)],
        }
        # The float32 state this rank keeps: its rows of the weights and gradients, AdamW's moments and the snapshots.
        state = [*learner.model.parameters(), *(p.grad for p in learner.model.parameters() if p.grad is not None),
                 *(v for st in learner.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()),
                 *(s for f in learner.fragments for s in f.snapshot)]
        out["state_bytes"] = sum(_local(t).numel() * _local(t).element_size() for t in state)
        if learner.layout.parallelism == "ddp":  # FSDP's gradients are sharded DTensors of its own
            grads = [p.grad for p in learner.model.parameters() if p.grad is not None]
            out.update(grads=len(grads), grad_storages=len({g.untyped_storage().data_ptr() for g in grads}))
        if rank == 0:
            out["ledger"] = _ledger_view(ctx)
            if cfg.synchronizer.retention.keep_submission_blobs:
                out["blobs"] = _submission_blobs(ctx)
        (workdir / f"rank-{rank}.json").write_text(json.dumps(out))
    finally:
        shutdown_dist(d)
        torch.set_num_threads(threads)


def _submission_blobs(ctx) -> dict[str, list[float]]:
    """Each submission's decoded outer gradient, flattened, by uid."""
    from ddiloco.platform.compression import decode_delta

    with ctx.transaction() as s:
        rows = s.execute(select(Submission.learner_id, Submission.uid, Submission.blob_key)).all()
    store = FragmentStore(ctx.cfg.storage.url)
    out = {}
    for learner_id, uid, key in rows:
        tensors, meta = store.get_with_metadata(key)
        out[f"{learner_id}/{uid}"] = torch.cat([t.reshape(-1) for _, t in sorted(decode_delta(tensors, meta).items())]).tolist()
    return out


LATE_LOSS = "late-loss"
"""A marker file in a job's folder: its ranks read each step's loss one step late, as a GPU learner's do."""


def run_two_ranks(workdir: Path, cfg, world: int = 2, *, late_loss: bool = False) -> list[dict]:
    """The ``world``-rank learner us-0 of ``cfg`` (rank 0 here, the others subprocesses); what each rank reported."""
    workdir.mkdir()
    if late_loss:
        (workdir / LATE_LOSS).touch()
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    run_ranks(__file__, workdir, world, rank_main)
    return [json.loads((workdir / f"rank-{r}.json").read_text()) for r in range(world)]


def test_two_gloo_ranks_equal_one_rank_with_twice_the_batch(tmp_path):
    cfg = one_learner_config()
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    # Its ranks read each step's loss one step late, as on GPUs: the loss of the previous step, summed over the ranks.
    ranks = run_two_ranks(tmp_path / "ddp", cfg, late_loss=True)
    # The reference: one process, batch 2B = rank 0's batch followed by rank 1's, from the same shards and seeds.
    _, clock, ctx, sync = _open_run(
        ref_dir, cfg.model_copy(update={"learners": cfg.learners.model_copy(update={"batch_size": 2 * B})})
    )
    ref = sim_learner(ctx, "us-0", index=0, num_learners=1)
    ref.start(clock.t)
    seed = cfg.seed * 1_000_003 + ref.incarnation
    ref._batches = _concat(*(ref.dataset.train_batches(r, 2, B, seed=seed) for r in range(2)))
    ref_losses = _drive(ref, sync, clock, STEPS)
    ref_ledger = _ledger_view(ctx)

    # The same fragments went out, were merged and came back: submissions and versions agree.
    ddp_ledger = ranks[0]["ledger"]
    assert [s[:6] for s in ddp_ledger["submissions"]] == [s[:6] for s in ref_ledger["submissions"]]
    assert ddp_ledger["versions"] == ref_ledger["versions"]
    assert len(ref_ledger["submissions"]) == STEPS and max(v for _, v in ref_ledger["versions"]) >= 1
    # Rank 0 registered the job's world, by which the synchronizer judged (and merged) its two ranks' tokens per step.
    assert ddp_ledger["world_sizes"] == {"us-0": 2} and ref_ledger["world_sizes"] == {"us-0": 1}
    # Token counts are sums over ranks; both ranks received the same fragments.
    assert ranks[0]["tokens_total"] == ranks[1]["tokens_total"] == ref.tokens_total == STEPS * 2 * B * cfg.model.seq_len
    assert ranks[0]["base"] == ranks[1]["base"] == ref.base and sum(ref.base) >= 3
    assert ranks[0]["losses"][0] is None and None not in ref_losses
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"][1:]), torch.tensor(ref_losses[:-1]), rtol=1e-5, atol=1e-6)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    # The gradients are views into DDP's all-reduce buckets (the tiny model's fit in one): no second copy of them.
    assert ranks[0]["grads"] == len(list(ref.model.parameters())) and ranks[0]["grad_storages"] == 1
    # Each rank keeps the float32 state `ddiloco config` sizes a ddp rank by: 20 bytes a parameter.
    numel = sum(p.numel() for p in ref.model.parameters())
    assert ranks[0]["state_bytes"] == ranks[1]["state_bytes"] == state_bytes_per_rank(numel, "ddp", 2) == 20 * numel
    got = [load_file(str(tmp_path / "ddp" / f"params-{r}.safetensors")) for r in range(2)]
    for name, p in ref.model.named_parameters():
        assert torch.equal(got[0][name], got[1][name]), f"ranks disagree on {name}"
        torch.testing.assert_close(got[0][name], p.detach(), rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# --- a rank dies: the job goes down, the ledger stays whole, a relaunch rejoins -----------------------------


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def _rank_pids(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the worker processes torchrun's agent started (found by their RANK variable)."""
    out = {}
    for pid in _children(agent_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = pid
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _submissions(run: ProcessRun, prefix: str = "") -> list:
    with run.ctx.reading() as s:
        return list(s.scalars(select(Submission).where(Submission.run_id == run.cfg.name, Submission.uid.like(f"{prefix}%"))))


def _state_key(run: ProcessRun) -> str | None:
    with run.ctx.reading() as s:
        return s.get(LearnerRow, (run.cfg.name, "us-0")).optimizer_state_key


@pytest.mark.slow
def test_sigkill_of_one_rank_ends_the_job_and_a_relaunch_rejoins(tmp_path):
    """A 2-rank FSDP learner loses a rank: the relaunched job resumes AdamW from its DCP state and its data from the
    newest registered submission; a later 1-rank job loads the same state resharded and goes on."""
    cfg = tiny_config(
        name="ddpkill",
        learners={
            "batch_size": B,
            "regions": [{"name": "us", "learners": 1}],
            "heartbeat_s": 0.5,
            "poll_s": 0.2,
            "dead_after_s": 5.0,
            "parallelism": "fsdp",
            "save_optimizer_every": 3,
        },
        fragments={"count": 4, "overlap": 2},
        synchronizer={
            "poll_s": 0.1,
            "lease_ttl_s": 1.5,
            "eval_every_s": 1000.0,
            "retention": {"keep_last": 100000, "keep_submission_blobs": True},
        },
        compression={"codec": "int8"},
    )
    run = ProcessRun(tmp_path, cfg)
    jobs: list[subprocess.Popen] = []
    # The synchronizer runs as a thread of the test: the processes under test are the learner job's.
    stop_sync = threading.Event()
    sync = threading.Thread(target=Synchronizer(run.ctx, holder="sync-t").run, args=(stop_sync,), daemon=True)
    try:
        sync.start()
        job = run.start("us-0", ProcessSpec.learner("us-0", nproc_per_node=2))
        jobs.append(job)
        wait_for(lambda: len(_submissions(run, "i0-")) >= 3, 120, "the 2-rank learner's first submissions")
        wait_for(lambda: _state_key(run) is not None, 60, "the 2-rank learner's first saved state")
        ranks = wait_for(lambda: len(_rank_pids(job.pid)) == 2 and _rank_pids(job.pid), 10, "two rank processes")
        with run.ctx.reading() as s:
            row = s.get(LearnerRow, ("ddpkill", "us-0"))
            assert row.pid == ranks[0] and row.incarnation == 0, "rank 0 is the learner in the ledger"
        killed_at = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        code = job.wait(timeout=90)
        down_s = time.monotonic() - killed_at
        assert code != 0, "a job that lost a rank must fail, so the supervisor relaunches it"
        assert down_s < 60, f"the job took {down_s:.0f}s to go down"
        wait_for(lambda: not _alive(ranks[0]), 30, "rank 0 to exit")
        log = run.log("us-0")
        assert "rank 1" in log and "exit" in log, log[-2000:]
        before = _submissions(run)
        with run.ctx.reading() as s:
            assert reports_q.token_accounting(s, "ddpkill").balanced
            position = s.get(LearnerRow, ("ddpkill", "us-0")).data_batches
        assert position and position > 0

        # The supervisor's move: relaunch the job (it rejoins from the newest global state and, with
        # --max-steps, ends cleanly). While it starts, check what the failed job left in the ledger.
        # Started as by hand: a store secret in its config file (the file store is given it and ignores it) and none
        # in its environment. The launcher hands its ranks a saved config, which holds the secret masked; a rank given
        # only the mask would refuse to open the run.
        by_hand = run.cfg.model_dump(mode="json")
        by_hand["storage"]["secrets"] = {"key": "planted-for-the-ranks"}
        (tmp_path / "by-hand.yaml").write_text(yaml.safe_dump(by_hand))
        relaunch = ProcessCluster(tmp_path / "by-hand.yaml", run.run_id, run.logdir).start(
            "us-0-relaunch", ProcessSpec.learner("us-0", nproc_per_node=2, max_steps=12))
        jobs.append(relaunch)
        store = FragmentStore(run.cfg.storage.url)
        tokens_per_step = 2 * B * cfg.model.seq_len  # two ranks
        assert len(before) >= 3 and all(sb.uid.startswith("i0-") for sb in before)
        for sb in before:
            assert store.verify(sb.blob_key, sb.sha256), f"{sb.uid} points to a missing or bad blob"
            assert sb.c_tokens == sb.c_steps * tokens_per_step, "a learner's tokens are the sum over its ranks"
        code = relaunch.wait(timeout=120)
        assert code == 0, run.log("us-0-relaunch")[-3000:]
        with run.ctx.reading() as s:
            row = s.get(LearnerRow, ("ddpkill", "us-0"))
            assert row.incarnation == 1
        again = _submissions(run, "i1-")
        # 12 steps, one fragment due a step: fragment f at the steps s with s % 4 == f. A send still queued behind an
        # upload of its fragment takes the next send of it in (the outbox's rule, which a loaded machine triggers: 9
        # blobs were seen), so each fragment's blobs are at its due steps and the last due one always goes out; the
        # token accounting below checks that what they carry adds up.
        due = {f: {step for step in range(1, 13) if step % 4 == f} for f in range(4)}
        sent = {f: {int(sb.uid.split("-")[1][1:]) for sb in again if sb.fragment == f} for f in range(4)}
        assert all(sent[f] <= due[f] and max(due[f]) in sent[f] for f in range(4)), [sb.uid for sb in again]
        wait_for(
            lambda: any(sb.status == "merged" for sb in _submissions(run, "i1-")), 60, "the relaunched job's work to be merged"
        )
        with run.ctx.reading() as s:
            assert reports_q.token_accounting(s, "ddpkill").balanced
            kinds = [e.kind for e in runs_q.events(s, "ddpkill")]
        assert "learner_restarted" in kinds
        # The relaunch resumed AdamW from the killed job's DCP state, and its data where the newest registered
        # submission left it: no micro-batch is trained twice.
        relaunched = run.log("us-0-relaunch")
        assert relaunched.count("resumes AdamW from") == 2, relaunched[-3000:]
        assert f"resumes its data at micro-batch {position}" in relaunched
        state = _state_key(run)
        assert state is not None and state.endswith("/i1-s12"), state

        # A job of another world size (one rank) loads that state resharded and goes on.
        single = run.start("us-0-single", ProcessSpec.learner("us-0", nproc_per_node=1, max_steps=4))
        jobs.append(single)
        code = single.wait(timeout=120)
        assert code == 0, run.log("us-0-single")[-3000:]
        assert "resumes AdamW from" in run.log("us-0-single") and "starting AdamW afresh" not in run.log("us-0-single")
        assert len(_submissions(run, "i2-")) == 4
        with run.ctx.reading() as s:
            assert s.get(LearnerRow, ("ddpkill", "us-0")).world_size == 1
    finally:
        for j in jobs:
            if j.poll() is None:
                j.send_signal(signal.SIGTERM)
        for j in jobs:
            try:
                j.wait(timeout=40)
            except subprocess.TimeoutExpired:
                j.kill()
        stop_sync.set()
        sync.join(timeout=10)
        run.stop_all()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "rank":
    rank_main(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
