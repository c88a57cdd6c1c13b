"""A learner as a data-parallel job: torch.distributed ranks, launched by torchrun, training with DDP.

In a deployment a learner is a slice of a cluster. Its ranks train one replica together with
``DistributedDataParallel`` (gloo on CPUs, NCCL on GPUs); to the rest of the platform the job is one
learner, and **rank 0 is its only voice**: it registers the incarnation, heartbeats, polls the ledger
for new global versions, computes and uploads outer gradients and registers the submissions. The other
ranks never open the ledger or the store (their context refuses to).

Lock-step protocol, once per inner step (every rank runs the same sequence of collectives):

1. *control* — one small ``all_reduce`` (SUM) of an int64 vector on a gloo group: every rank votes
   whether to stop; rank 0 alone writes which fragments to apply (id, version) and which fragments the
   learner is waiting for (overlap-0 mode). All ranks therefore apply the same fragments at the same step,
   stop at the same step, and skip the same steps.
2. *fragments* — if the apply list is not empty, rank 0 broadcasts the new global tensors (one flat
   buffer, on the training device); every rank overwrites (blends, or rebases onto) its parameters with them.
3. *train* — one DDP step on this rank's batch (gradients averaged over ranks), AdamW, and an
   ``all_reduce`` of (loss × tokens, tokens): the learner's tokens are the sum over ranks, its loss the
   token-weighted mean.
4. *send* — at rank 0 only, for each due fragment: the parameters are staged to host memory off the
   training stream (``device.HostStager``) and the outer gradient is computed and uploaded by the upload
   thread. With DDP every rank holds identical parameters, so rank 0's copy is the learner's.

Data: rank ``r`` of learner ``L`` reads shard ``L * world + r`` of ``num_learners * world``. The ranks'
shards are disjoint and their union is exactly learner ``L``'s shard in the single-process layout.

Failure: collectives have a timeout (``DDILOCO_DIST_TIMEOUT_S``, default 60 s); a rank that dies makes
its peers' next collective fail (at once for a closed connection, after the timeout for a hung rank), the
ranks exit, torchrun (``max_restarts=0``) stops the job, and the supervisor relaunches it: the new job
registers a new incarnation and rejoins from the newest global state like any learner. Rank 0 flushes
the uploads it has already queued before it exits, so every registered submission is whole.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddiloco.learner_worker.device import (
    HostStager,
    Staged,
    autocast,
    backend_for,
    resolve_device,
    set_device,
)
from ddiloco.learner_worker.process import LearnerJobFailed, resolve_learner
from ddiloco.learner_worker.worker import Learner, Outgoing, rebases, receive_tensor
from ddiloco.platform.config import RunConfig
from ddiloco.platform.data import Batch
from ddiloco.platform.models import compute_loss
from ddiloco.platform.runtime import RunContext

log = logging.getLogger("ddiloco.learner")

TIMEOUT_ENV = "DDILOCO_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
"""Longest a collective may wait for a peer before the rank gives up (and the job goes down)."""
SHUTDOWN_TIMEOUT_S = 30
"""How long torchrun lets the remaining ranks finish (flush uploads) after SIGTERM before SIGKILL."""


# --- ranks and process groups ------------------------------------------------------------------


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int
    local_rank: int


def rank_env() -> RankInfo | None:
    """This process's place in a torchrun job (RANK, WORLD_SIZE, LOCAL_RANK), or None outside one."""
    try:
        return RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    except (KeyError, ValueError):
        return None


def collective_timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        log.warning("%s=%r is not a number; using %.0f s", TIMEOUT_ENV, raw, DEFAULT_TIMEOUT_S)
        return DEFAULT_TIMEOUT_S


@dataclass
class Dist:
    """A learner's ranks: this rank, the world, the training device and the process groups."""

    rank: int
    world: int
    device: torch.device
    control: Any = None
    """gloo group for the per-step control vector and the loss/token sums (CPU tensors)."""
    bootstrap: Any = None
    """gloo group with a long timeout: the other ranks wait on it while rank 0 waits for version 0."""

    @classmethod
    def single(cls, device: torch.device) -> Dist:
        """One rank, no process group: a device-aware learner on its own."""
        return cls(rank=0, world=1, device=device)


def init_dist(
    device: torch.device,
    *,
    timeout_s: float,
    ready_timeout_s: float,
    init_method: str = "env://",
    rank: int | None = None,
    world: int | None = None,
) -> Dist:
    """Join the learner's process group (env:// under torchrun) and create the side groups."""
    backend = backend_for(device)
    set_device(device)
    kwargs: dict[str, Any] = {"backend": backend, "init_method": init_method, "timeout": timedelta(seconds=timeout_s)}
    if rank is not None:
        kwargs.update(rank=rank, world_size=world)
    dist.init_process_group(**kwargs)
    if backend == "gloo":
        control = dist.group.WORLD
    else:
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    bootstrap = dist.new_group(backend="gloo", timeout=timedelta(seconds=ready_timeout_s + timeout_s))
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), device=device, control=control, bootstrap=bootstrap)


def shutdown_dist(d: Dist) -> None:
    if d.world > 1 and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            log.debug("destroy_process_group failed", exc_info=True)


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Linux: get ``sig`` when the launcher dies, so no rank outlives a SIGKILLed torchrun agent."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


class RankContext:
    """What a rank other than 0 may use of a RunContext: the config and the clock — never the ledger or store."""

    def __init__(self, cfg: RunConfig, run_id: str, clock=time.time) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.clock = clock

    def now(self) -> float:
        return self.clock()

    def _refuse(self, *_args, **_kwargs):
        raise RuntimeError("only rank 0 of a learner talks to the ledger and the fragment store")

    transaction = reading = store = _refuse


# --- the learner -------------------------------------------------------------------------------


class _LossModule(nn.Module):
    """The model plus its loss, so DDP's forward covers models with their own ``compute_loss`` or aux losses."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.device = device

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, tokens: int) -> torch.Tensor:
        with autocast(self.device):
            loss, _info = compute_loss(self.model, Batch(inputs=inputs, targets=targets, tokens=tokens))
        return loss


class PendingDelta:
    """An outer-gradient increment whose host copy may still be in flight; the upload thread resolves it."""

    def __init__(
        self,
        base: dict[str, torch.Tensor] | Staged,
        current: Staged,
        names: tuple[str, ...],
        carried: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.base = base
        self.current = current
        self.names = names
        self.carried = carried

    def result(self) -> dict[str, torch.Tensor]:
        base = self.base.wait() if isinstance(self.base, Staged) else self.base
        current = self.current.wait()
        with torch.no_grad():
            delta = {n: base[n] - current[n] for n in self.names}
            if self.carried is not None:
                delta = {n: delta[n] + self.carried[n] for n in self.names}
        return delta


@dataclass
class Control:
    stop: bool
    apply: list[tuple[int, int]]
    """(fragment, version) every rank applies before this step, in fragment order."""
    awaiting: set[int]
    """Fragments the learner still waits for (overlap 0): while not empty, no rank trains."""
    arrived: dict[int, tuple[int, dict[str, torch.Tensor]]]
    """Rank 0 only: the downloaded tensors behind ``apply``."""


class DistributedLearner(Learner):
    """One rank of a data-parallel learner. Rank 0 is a full :class:`Learner`; the others only train."""

    def __init__(
        self,
        ctx: RunContext | RankContext,
        learner_id: str,
        region: str,
        *,
        index: int,
        num_learners: int,
        dist_: Dist,
        speed: float = 1.0,
        background_io: bool = True,
        flow_run_url: str | None = None,
    ) -> None:
        self.dist = dist_
        self.rank = dist_.rank
        self.world = dist_.world
        self.device = dist_.device
        super().__init__(
            ctx,  # type: ignore[arg-type] - a RankContext on ranks > 0
            learner_id,
            region,
            index=index,
            num_learners=num_learners,
            speed=speed,
            background_io=background_io and dist_.rank == 0,
            flow_run_url=flow_run_url,
        )
        # .to() keeps the Parameter objects, so the optimizer and self.params stay valid.
        self.model.to(self.device)
        self.loss_module = _LossModule(self.model, self.device)
        self.ddp: DDP | None = None
        if self.world > 1:
            self.ddp = DDP(
                self.loss_module,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                # MoE experts (and arbitrary imported models) may leave parameters unused in a step.
                find_unused_parameters=self.cfg.model.kind in ("moe_gpt", "import"),
            )
        self.stager = HostStager(self.device)
        self._pending: Control | None = None
        self._waiting = False
        self._bootstrapped = False
        self._staged_snapshot: dict[int, Staged] = {}
        # Time on the training thread spent on fragment I/O (rank 0 figures; see docs/ddp.md).
        self.control_s = 0.0
        self.apply_s = 0.0
        self.send_s = 0.0
        self.train_s = 0.0

    # --- hooks of Learner ---------------------------------------------------------------------

    def train_stream(self) -> Iterator[Batch]:
        """Shard ``index * world + rank`` of ``num_learners * world``: disjoint per rank, the learner's shard in union."""
        return self.dataset.train_batches(
            self.index * self.world + self.rank,
            self.num_learners * self.world,
            self.cfg.learners.batch_size,
            seed=self.cfg.seed * 1_000_003 + self.incarnation,
        )

    def is_waiting(self) -> bool:
        return self._waiting

    def tokens_per_step(self) -> int:
        return self.world * super().tokens_per_step()

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self, now: float | None = None) -> None:
        if self.rank == 0:
            # Registers, loads, polls; its apply_received() runs the bootstrap and the first exchange.
            super().start(now)
            return
        self._bootstrap()
        self._batches = self.train_stream()
        self.apply_received()
        if min(self.base) < 0:
            raise RuntimeError(f"rank {self.rank} did not receive every fragment at bootstrap")

    def _bootstrap(self) -> None:
        """Rank 0 tells the others its incarnation (it seeds the data) and its restored AdamW state."""
        if self.world > 1:
            payload: list[Any] = [None]
            if self.rank == 0:
                payload = [{"incarnation": self.incarnation, "optimizer": self.optimizer_state_tensors()}]
            dist.broadcast_object_list(payload, src=0, group=self.dist.bootstrap)
            if self.rank != 0:
                self.incarnation = int(payload[0]["incarnation"])
                self._load_optimizer_tensors(payload[0]["optimizer"])
        self._bootstrapped = True

    def run(self, stop: threading.Event, max_steps: int | None = None, wait_timeout_s: float = 60.0) -> None:
        """Step until any rank is stopped, rank 0 sees the run finish, or ``max_steps`` — all ranks together."""
        while True:
            want_stop = stop.is_set() or self.run_finished or (max_steps is not None and self.step_count >= max_steps)
            control = self._exchange(want_stop)
            if control.stop:
                break
            self._pending = control
            report = self.step()
            if report.waiting and self.rank == 0:
                self.wait_for_awaited(min(wait_timeout_s, 1.0))

    # --- control and receipt ----------------------------------------------------------------------

    def _exchange(self, want_stop: bool) -> Control:
        t0 = time.perf_counter()
        P = len(self.fragments)
        vec = torch.zeros(1 + 3 * P, dtype=torch.int64)
        vec[0] = int(want_stop)
        arrived: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        if self.rank == 0:
            with self._lock:
                arrived, self._inbox = self._inbox, {}
                awaiting = set(self.awaiting) - set(arrived)
            for p, (version, _tensors) in arrived.items():
                vec[1 + p] = 1
                vec[1 + P + p] = version
            for p in awaiting:
                vec[1 + 2 * P + p] = 1
        if self.world > 1:
            dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.dist.control)
        values = vec.tolist()
        control = Control(
            stop=values[0] > 0,
            apply=[(p, values[1 + P + p]) for p in range(P) if values[1 + p]],
            awaiting={p for p in range(P) if values[1 + 2 * P + p]},
            arrived=arrived,
        )
        if control.stop and arrived:
            with self._lock:  # not applied: keep them (a stopped learner may still be asked for its state)
                for p, item in arrived.items():
                    self._inbox.setdefault(p, item)
        self.control_s += time.perf_counter() - t0
        return control

    def apply_received(self) -> list[int]:
        """Apply, on every rank, the fragments rank 0 chose for this step (broadcast from rank 0)."""
        if not self._bootstrapped:
            self._bootstrap()
        control, self._pending = self._pending, None
        if control is None:
            control = self._exchange(want_stop=False)
        t0 = time.perf_counter()
        if control.apply:
            self._apply(control)
        if self.rank == 0:
            with self._lock:
                self.awaiting.difference_update(p for p, _ in control.apply)
        else:
            self.awaiting = set(control.awaiting)
        self._waiting = bool(control.awaiting)
        self.apply_s += time.perf_counter() - t0
        return [p for p, _ in control.apply]

    def _apply(self, control: Control) -> None:
        names = [(p, n) for p, _ in control.apply for n in self.fragments[p].names]
        sizes = [self.params[n].numel() for _, n in names]
        # rebase (see Learner.apply_received): every rank adds G - S, which rank 0 computes from its
        # host snapshot; base and c_steps are the same on every rank, so they all agree on the set.
        rebase = {p for p, _ in control.apply if rebases(self.cfg.merge.on_receipt, self.base[p], self.c_steps[p])}
        if self.rank == 0:
            snaps = {}
            for p in rebase:
                staged = self._staged_snapshot.get(p)
                snaps[p] = staged.wait() if staged is not None else self.snapshot[p]
            flat = torch.cat([
                (control.arrived[p][1][n] - snaps[p][n] if p in rebase else control.arrived[p][1][n]).reshape(-1).to(torch.float32)
                for p, n in names
            ]).to(self.device)
        else:
            flat = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
        if self.world > 1:
            dist.broadcast(flat, src=0)
        incoming = {n: t.view(self.params[n].shape) for (_, n), t in zip(names, flat.split(sizes))}
        alpha = self.cfg.merge.blend_alpha if self.cfg.merge.on_receipt == "blend" else 1.0
        with torch.no_grad():
            for p, version in control.apply:
                first = self.base[p] < 0
                for n in self.fragments[p].names:
                    receive_tensor(self.params[n], incoming[n], rebase=p in rebase, first=first, alpha=alpha)
                if self.rank == 0:
                    # The snapshot is the global fragment as stored (host memory), as in Learner.apply_received.
                    self.snapshot[p] = {n: t.clone() for n, t in control.arrived[p][1].items()}
                self._staged_snapshot.pop(p, None)
                self.base[p] = version
                if p not in rebase:
                    self.c_steps[p] = 0
                    self.c_tokens[p] = 0

    # --- training -----------------------------------------------------------------------------

    def train_step(self) -> tuple[float, int]:
        """One DDP step on this rank's batch: (learner loss, learner tokens), summed over ranks."""
        t0 = time.perf_counter()
        batch = next(self._batches)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step_count)
        inputs = batch.inputs.to(self.device, non_blocking=True)
        targets = batch.targets.to(self.device, non_blocking=True)
        net = self.ddp if self.ddp is not None else self.loss_module
        loss = net(inputs, targets, batch.tokens)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # Gradients are already averaged over ranks (identical everywhere): clipping needs no communication.
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
        self.optimizer.step()
        stats = torch.tensor([float(loss.detach()) * batch.tokens, float(batch.tokens)], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=self.dist.control)
        loss_sum, tokens = stats.tolist()
        self.train_s += time.perf_counter() - t0
        return loss_sum / tokens, int(tokens)

    # --- sending (rank 0) ---------------------------------------------------------------------

    def send(self, fragment: int, now: float) -> None:
        """Rank 0: stage the fragment to host memory and queue its outer gradient; other ranks: reset counters."""
        if self.rank != 0:
            self.c_steps[fragment] = 0
            self.c_tokens[fragment] = 0
            return
        t0 = time.perf_counter()
        frag = self.fragments[fragment]
        staged = self.stager.stage({n: self.params[n] for n in frag.names})
        with self._lock:
            tokens_new, self._tokens_unsubmitted = self._tokens_unsubmitted, 0
            carried = self._carry.pop(fragment, None)
        base = self._staged_snapshot.get(fragment) or self.snapshot[fragment]
        delta = PendingDelta(base, staged, frag.names, carried.delta if carried is not None else None)
        out = Outgoing(
            fragment=fragment,
            base_version=self.base[fragment],
            delta=delta,  # type: ignore[arg-type] - resolved by upload_many
            c_steps=self.c_steps[fragment] + (carried.c_steps if carried else 0),
            c_tokens=self.c_tokens[fragment] + (carried.c_tokens if carried else 0),
            tokens_new=tokens_new + (carried.tokens_new if carried else 0),
            tokens_total=self.tokens_total,
            step=self.step_count,
            created_at=now,
        )
        # As in Learner.send: the next send of this fragment carries only what was learned after this one.
        self.snapshot[fragment] = staged.tensors
        self._staged_snapshot[fragment] = staged
        self.c_steps[fragment] = 0
        self.c_tokens[fragment] = 0
        if self.cfg.fragments.overlap == 0:
            with self._lock:
                self.awaiting.add(fragment)
        self._queue(out)
        self.send_s += time.perf_counter() - t0

    def upload_many(self, outs: list[Outgoing]) -> None:
        t0 = time.perf_counter()
        for out in outs:
            if isinstance(out.delta, PendingDelta):
                out.delta = out.delta.result()
        self.upload_s += time.perf_counter() - t0
        super().upload_many(outs)

    def _queue(self, item) -> None:
        if self.rank == 0:
            super()._queue(item)

    def heartbeat(self, now: float, force: bool = False) -> None:
        if self.rank == 0:
            super().heartbeat(now, force)

    # --- optimizer state ----------------------------------------------------------------------

    def optimizer_state_tensors(self) -> dict[str, torch.Tensor]:
        """AdamW's state as host tensors (safetensors blobs and the bootstrap broadcast need host memory)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for p, st in self.optimizer.state.items():
            for key, value in st.items():
                if torch.is_tensor(value):
                    out[f"{names[id(p)]}::{key}"] = value.detach().to("cpu", copy=True)
        return out

    def load_optimizer_state(self, key: str, sha256: str) -> bool:
        ok = super().load_optimizer_state(key, sha256)
        self._move_optimizer_state()
        return ok

    def _load_optimizer_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, p in self.model.named_parameters():
            st = {k.split("::", 1)[1]: v for k, v in tensors.items() if k.split("::", 1)[0] == name}
            if st:
                self.optimizer.state[p] = st
        self._move_optimizer_state()

    def _move_optimizer_state(self) -> None:
        """Moments next to their parameter; AdamW keeps its scalar ``step`` on the host."""
        for p, st in self.optimizer.state.items():
            for key, value in list(st.items()):
                if torch.is_tensor(value) and value.dim() > 0 and value.device != p.device:
                    st[key] = value.to(p.device)

    def figures(self) -> dict[str, float]:
        """Rank-local timings for benchmarks and the job summary."""
        return {
            "train_s": self.train_s,
            "control_s": self.control_s,
            "apply_s": self.apply_s,
            "send_s": self.send_s,
            "upload_s": self.upload_s,
        }


# --- processes -----------------------------------------------------------------------------------


@dataclass
class JobSummary:
    """What rank 0 reports when a learner job ends (``run_learner`` returns it for a multi-rank job)."""

    learner_id: str
    incarnation: int
    world_size: int
    device: str
    step_count: int
    tokens_total: int
    wall_s: float
    figures: dict[str, float]


def run_learner_rank(
    cfg: RunConfig,
    run_id: str,
    learner_id: str,
    *,
    max_steps: int | None = None,
    ready_timeout_s: float = 300.0,
    flow_run_url: str | None = None,
    summary_path: str | os.PathLike[str] | None = None,
) -> DistributedLearner:
    """One rank of a learner job (under torchrun), or a lone device-aware learner outside one."""
    index, region, speed = resolve_learner(cfg, learner_id)
    info = rank_env()
    if info is not None:
        set_parent_death_signal(signal.SIGTERM)
    torch.set_num_threads(cfg.learners.torch_threads)
    stop = threading.Event()

    def _on_signal(signum, _frame) -> None:
        log.info("learner %s rank %s got signal %s: stopping with the other ranks", learner_id, info.rank if info else 0, signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
    device = resolve_device(cfg.learners.device, info.local_rank if info else 0)
    if info is not None and info.world > 1:
        d = init_dist(device, timeout_s=collective_timeout_s(), ready_timeout_s=ready_timeout_s)
    else:
        d = Dist.single(device)
    t0 = time.monotonic()
    try:
        ctx = RunContext.open(cfg, run_id) if d.rank == 0 else RankContext(cfg, run_id)
        learner = DistributedLearner(
            ctx, learner_id, region, index=index, num_learners=cfg.learners.count, dist_=d, speed=speed, flow_run_url=flow_run_url
        )
        learner.wait_until_ready(ready_timeout_s)
        if d.rank == 0:
            log.info(
                "learner %s (incarnation %s) joined run %s in region %s: %s ranks on %s",
                learner_id, learner.incarnation, run_id, region, d.world, device,
            )
        try:
            learner.run(stop, max_steps=max_steps)
        except Exception:
            if d.world > 1:
                log.error(
                    "learner %s rank %s: stepping failed (a collective fails when a peer rank died or hung); "
                    "this rank exits and torchrun stops the job", learner_id, d.rank,
                )
            raise
        finally:
            learner.stop(flush=True)
    finally:
        shutdown_dist(d)
    if d.rank == 0:
        log.info("learner %s stopped after %s steps, %s tokens over %s ranks", learner_id, learner.step_count, learner.tokens_total, d.world)
        if summary_path:
            summary = JobSummary(
                learner_id=learner_id, incarnation=learner.incarnation, world_size=d.world, device=str(device),
                step_count=learner.step_count, tokens_total=learner.tokens_total, wall_s=time.monotonic() - t0,
                figures=learner.figures(),
            )
            Path(summary_path).write_text(json.dumps(asdict(summary)))
    return learner


def torchrun_command(
    nproc_per_node: int, config_path: str | os.PathLike[str], run_id: str, learner_id: str, *,
    max_steps: int | None = None, summary_path: str | os.PathLike[str] | None = None, flow_run_url: str | None = None,
    verbose: bool = False,
) -> list[str]:
    """The torchrun arguments ``ddiloco learner --nproc-per-node N`` runs (the same as typing ``torchrun …``)."""
    # --run-id, not --run: torchrun's argument parser would take --run for an abbreviation of its --run-path.
    args = [
        "--standalone", "--nproc-per-node", str(nproc_per_node), "--max-restarts", "0", "--monitor-interval", "0.2",
        "-m", "ddiloco", "learner", "--config", str(config_path), "--run-id", run_id, "--learner", learner_id,
    ]
    if max_steps is not None:
        args += ["--max-steps", str(max_steps)]
    if summary_path is not None:
        args += ["--summary-json", str(summary_path)]
    if flow_run_url:
        args += ["--flow-run-url", flow_run_url]
    if verbose:
        args.append("--verbose")
    return args


def launch_learner_job(
    cfg: RunConfig,
    run_id: str,
    learner_id: str,
    nproc_per_node: int,
    *,
    max_steps: int | None = None,
    flow_run_url: str | None = None,
    verbose: bool = False,
) -> JobSummary | None:
    """Run a learner as ``nproc_per_node`` ranks on this machine through torchrun's elastic agent.

    ``max_restarts=0``: a rank that fails stops the whole job (the others get SIGTERM, then SIGKILL after
    ``SHUTDOWN_TIMEOUT_S``) and this raises :class:`LearnerJobFailed`; relaunching is the supervisor's
    job, and a relaunch rejoins from the newest global state. Returns rank 0's summary."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    with tempfile.TemporaryDirectory(prefix="ddiloco-learner-") as tmp:
        # The effective config (file + env overrides) goes to every rank, whoever built it.
        config_path = Path(tmp) / "config.yaml"
        config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        summary_path = Path(tmp) / "summary.json"
        args = get_args_parser().parse_args(
            torchrun_command(
                nproc_per_node, config_path, run_id, learner_id, max_steps=max_steps, summary_path=summary_path,
                flow_run_url=flow_run_url, verbose=verbose,
            )
        )
        # What torchrun's run() does for --standalone: a private c10d rendezvous on a free port.
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        if args.master_port is None:
            args.master_port = 29500
        config, cmd, cmd_args = config_from_args(args)
        config.shutdown_timeout = SHUTDOWN_TIMEOUT_S
        log.info("learner %s: launching %s ranks (torchrun %s)", learner_id, nproc_per_node, " ".join(cmd_args))
        try:
            elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
        except ChildFailedError as err:
            failures = ", ".join(
                f"rank {rank} exit {f.exitcode}" + (f" ({f.signal_name()})" if f.exitcode < 0 else "")
                for rank, f in sorted(err.failures.items())
            )
            raise LearnerJobFailed(f"learner {learner_id} job failed: {failures}") from None
        except SignalException as sig:
            # SIGTERM/SIGINT to the launcher: torchrun passed it on, the ranks stopped together and flushed.
            log.info("learner %s job stopped by signal %s", learner_id, sig.sigval)
            return None
        if not summary_path.exists():
            return None
        return JobSummary(**json.loads(summary_path.read_text()))
