"""A learner: trains its own replica and trades parameter fragments with the synchronizer.

One class for every world size and parallelism. A learner is one process, or a job of ``world`` ranks
under torchrun (gloo on CPUs, NCCL on GPUs) whose replica is spread by ``learners.parallelism``: DDP
(a whole copy per rank), FSDP2 (row shards) or HSDP (``parallel.py``); world size 1 runs the same
loop. Rank 0 is the learner's only voice: its :class:`~ddiloco.learner_worker.link.LearnerLink`
registers, uploads, downloads and heartbeats off the training thread; the other ranks never open
the ledger or the store.

Once per inner step every rank runs the same sequence, so all ranks apply the same fragments at the
same step, stop at the same step and skip the same steps:

1. *agree* — a small ``all_reduce`` of an int64 vector: every rank votes whether to stop; rank 0
   alone writes which fragments to apply (id, version), which it still waits for (overlap 0) and
   the send period in force (``fragments.adaptive``: its link's choice, see ``cadence.py``).
2. *receive* — rank 0 broadcasts the arrived global tensors (one flat buffer); every rank folds its
   rows of them into its parameters (``merge.on_receipt``: overwrite, blend or rebase).
3. *train* — one step on this rank's batch; loss and tokens are summed over ranks. On a GPU a step's loss
   is read one step late (``LateRead``): the host never waits for the step it just queued.
4. *send* — for each due fragment every rank takes the increment of its rows since the previous send
   (tensor ops on the training device, against a snapshot kept there), rank 0 gathers its shard
   group's rows and hands the increment to the link, which encodes it where it lives (a side stream
   on GPUs): only encoded bytes reach host memory.

It never waits for anyone, except in the overlap-0 mode (synchronous DiLoCo)."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddiloco.learner_worker.cadence import Cadence, CadencePolicy, initial_cadence
from ddiloco.learner_worker.device import Increment, LateRead, autocast, resolve_device
from ddiloco.learner_worker.dist import Dist, ensure_process_group
from ddiloco.learner_worker.downloader import Arrival
from ddiloco.learner_worker.flops import ModelCost
from ddiloco.learner_worker.link import HeartbeatStats, LearnerLink, Resume
from ddiloco.learner_worker.outbox import Outgoing
from ddiloco.learner_worker.parallel import (
    Layout,
    LocalPiece,
    cache_off_advice,
    checkpoint_blocks,
    gather_pieces,
    gather_sizes,
    local_pieces,
    local_tensor,
    shard_replica,
)
from ddiloco.learner_worker.schedule import lr_factor, param_groups, schedule_steps
from ddiloco.learner_worker.state import load_state, make_stager, save_state
from ddiloco.platform.compression import Tensors, codec_nbytes
from ddiloco.platform.config import RunConfig, codec_ladder
from ddiloco.platform.data import Batch, build_dataset
from ddiloco.platform.faults import fault_point
from ddiloco.platform.fragments import Fragment, due_fragments, partition_module
from ddiloco.platform.models import build_model, training_loss
from ddiloco.platform.redact import redact_url
from ddiloco.platform.spans import span

log = logging.getLogger("ddiloco.learner")

STATE_WRITE_TIMEOUT_S = 120.0
"""How long a stopping learner waits for its state to be written (an unwritten one is never pointed at)."""


def rebases(mode: str, base_version: int, c_steps: int) -> bool:
    """Whether a receipt rebases: only in rebase mode, onto a fragment already held, with unsent
    progress (without any, rebase is exactly overwrite)."""
    return mode == "rebase" and base_version >= 0 and c_steps > 0


@dataclass
class Tally:
    """The inner steps and tokens a learner trained since it started: a fragment's unsent counts are what it has
    grown by since the fragment's last send or receipt, so a step adds to one tally, not to every fragment."""

    steps: int = 0
    tokens: int = 0


@dataclass
class FragmentState:
    """One fragment of the replica on this rank: the global version it last received, what it has not sent yet,
    and this rank's rows of it (all of them unless the replica is sharded, see ``parallel.py``).

    ``snapshot`` holds, beside each live view, the global fragment as received or the parameters as of the
    last send, on the training device: the next send carries ``snapshot − params``, only what was learned
    since, so a learner that sends twice before it hears back is never merged twice."""

    pieces: list[LocalPiece]
    """This rank's rows of each piece of the fragment, in the fragment's order."""
    shapes: list[torch.Size]
    """The whole shape of each piece."""
    sizes: list[list[int]]
    """Per shard of rank 0's group, its elements of each piece (what a gather moves)."""
    snapshot: list[torch.Tensor] = field(default_factory=list)
    base: int = -1
    tally: Tally = field(default_factory=Tally)
    """The learner's tally, shared by its fragments."""
    marks: tuple[int, int] = (0, 0)
    """The tally's (steps, tokens) when the counts last restarted."""
    last_sent: int | None = None
    """The inner step of its last send (None: not sent yet)."""

    def __post_init__(self) -> None:
        self.views = [pc.view for pc in self.pieces]
        self.keys = [pc.key for pc in self.pieces]
        if not self.snapshot:
            self.snapshot = [torch.empty_like(v) for v in self.views]

    @property
    def tensors(self) -> Tensors:
        """This rank's live rows of the fragment by piece key (the whole pieces unless sharded)."""
        return dict(zip(self.keys, self.views))

    def snapshot_tensors(self) -> Tensors:
        return dict(zip(self.keys, self.snapshot))

    @torch.no_grad()
    def take_increment(self, keep: bool) -> tuple[list[torch.Tensor] | None, int, int]:
        """This rank's rows of the increment since the last send or receipt (None unless ``keep``), with its
        steps and tokens; the snapshot moves to the parameters and counting restarts."""
        increment = torch._foreach_sub(self.snapshot, self.views) if keep else None
        torch._foreach_copy_(self.snapshot, self.views)
        counts = (self.c_steps, self.c_tokens)
        self.reset_counts()
        return increment, *counts

    @property
    def c_steps(self) -> int:
        """Inner steps not yet sent."""
        return self.tally.steps - self.marks[0]

    @property
    def c_tokens(self) -> int:
        """Tokens of those steps."""
        return self.tally.tokens - self.marks[1]

    def reset_counts(self) -> None:
        self.marks = (self.tally.steps, self.tally.tokens)

    @torch.no_grad()
    def receive(self, version: int, incoming: Tensors, *, rebase: bool, alpha: float) -> None:
        """Fold the arrived global fragment (whole pieces, on the training device) into this rank's rows.

        Rebase keeps the unsent counts, since the next send still carries those steps; overwrite and
        blend discard or halve them. The snapshot becomes the global fragment in every mode."""
        g = [incoming[pc.key].narrow(0, pc.first, pc.rows) if incoming[pc.key].dim() else incoming[pc.key]
             for pc in self.pieces]
        if rebase:
            torch._foreach_add_(self.views, torch._foreach_sub(g, self.snapshot))
        elif self.base < 0 or alpha >= 1.0:
            torch._foreach_copy_(self.views, g)
        else:
            torch._foreach_mul_(self.views, 1 - alpha)
            torch._foreach_add_(self.views, g, alpha=alpha)
        torch._foreach_copy_(self.snapshot, g)
        self.base = version
        if not rebase:
            self.reset_counts()


def fragment_states(model: nn.Module, parts: list[Fragment], layout: Layout, tally: Tally) -> list[FragmentState]:
    """This rank's state of each fragment of ``model`` (already wrapped by its ``layout``): live views of the rows it
    holds and a snapshot of them on the training device, 4 bytes a parameter held."""
    with torch.no_grad():
        local = {n: local_tensor(p) for n, p in model.named_parameters()}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    return [FragmentState(local_pieces(f, local, shapes, layout), [torch.Size(pc.shape) for pc in f.pieces],
                          gather_sizes(f, shapes, layout), tally=tally) for f in parts]


@dataclass
class StepReport:
    step: int
    loss: float | None
    """The learner's loss of the step read at this one: this step's, or on a GPU the step before's (``LateRead``);
    None when no step's loss was read (the first step on a GPU, a step that did not train)."""
    tokens: int
    submitted: list[int] = field(default_factory=list)
    received: list[int] = field(default_factory=list)
    waiting: bool = False
    stopped: bool = False
    compute_s: float = 0.0


@dataclass
class Control:
    """What all ranks agreed on for one step."""

    stop: bool
    apply: list[tuple[int, int]]
    """(fragment, version) every rank applies before this step, in fragment order."""
    awaiting: set[int]
    """Fragments still awaited (overlap 0): while not empty, no rank trains."""
    arrived: dict[int, Arrival]
    """Rank 0 only: the downloaded tensors behind ``apply``."""
    every: int = 0
    """The send period rank 0 chose for this step (0: none was given, H)."""


def cadence_policy(cfg: RunConfig, fragments: list[Fragment]) -> CadencePolicy:
    """What an adaptive learner of this run may choose from: its fragments' encoded sizes per codec."""
    f = cfg.fragments
    codecs = codec_ladder(cfg.compression.codec, f.adaptive_min_codec)
    sizes = tuple(
        sum(codec_nbytes(pc.numel, c, cfg.compression.block_size) for frag in fragments for pc in frag.pieces) / len(fragments)
        for c in codecs
    )
    return CadencePolicy(period=f.period, fragments=len(fragments), codecs=codecs, fragment_bytes=sizes,
                         max_periods=f.adaptive_max_periods)


class _LossModule(nn.Module):
    """The model plus its loss, so DDP's forward covers models with their own ``compute_loss`` or aux losses."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.device = device

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, tokens: int) -> torch.Tensor:
        with autocast(self.device):
            return training_loss(self.model, Batch(inputs=inputs, targets=targets, tokens=tokens))


class Learner:
    def __init__(
        self,
        cfg: RunConfig,
        learner_id: str,
        *,
        index: int,
        num_learners: int,
        link: LearnerLink | None,
        dist: Dist | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.id = learner_id
        self.index = index
        self.num_learners = num_learners
        # Without a process group, one rank on the device the config names (auto: a GPU when there is one).
        self.dist = dist or Dist.single(resolve_device(cfg.learners.device))
        if (link is None) != (self.dist.rank != 0):
            raise ValueError("rank 0 of a learner needs a link to its run, and only rank 0 may have one")
        self.link = link
        self.clock = clock
        self.device = self.dist.device
        # .to() keeps the Parameter objects, so the optimizer and the fragments' views stay valid.
        self.model = build_model(cfg.model, seed=cfg.seed).to(self.device)
        self.model.train()
        ac = cfg.learners.activation_checkpoint
        self.checkpointed_blocks = checkpoint_blocks(self.model, ac) if ac != "none" else 0
        """Blocks that recompute their activations in the backward pass (``learners.activation_checkpoint``)."""
        advice = cache_off_advice(self.model, self.device, cfg.learners.compile)
        if advice and self.dist.rank == 0:
            log.warning("learner %s: %s", learner_id, advice)
        parts = partition_module(self.model, cfg.fragments.count)
        self.loss_module = _LossModule(self.model, self.device)
        self.ddp = None
        self.layout = Layout("ddp")
        if cfg.learners.parallelism != "ddp":
            # Sharding cuts each parameter into row shards in place: the fragments' views are taken after it.
            ensure_process_group(self.dist)
            self.layout = shard_replica(self.model, cfg.learners.parallelism, cfg.learners.shard_size, self.dist.rank,
                                        self.dist.world, self.device)
        elif self.dist.world > 1:
            self.ddp = DDP(
                self.loss_module,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                # MoE experts (and arbitrary imported models) may leave parameters unused in a step.
                find_unused_parameters=cfg.model.kind in ("moe_gpt", "import"),
                # Each gradient a view into DDP's all-reduce buckets: one copy of the gradients per rank, not two
                # (4 bytes a parameter: 4 GB of a 1B replica's GPU memory), and no copy between them each step.
                gradient_as_bucket_view=True,
            )
        self.tally = Tally()
        self.fragments = fragment_states(self.model, parts, self.layout, self.tally)
        if link is not None:
            link.configure(len(self.fragments), cadence_policy(cfg, parts) if cfg.fragments.adaptive else None,
                           self.dist.world, pin_arrivals=self.device.type == "cuda",
                           decode_on=self.device if cfg.learners.decode_on_device else None)
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, cfg.inner.weight_decay), lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2)
        )
        self.total_steps = schedule_steps(cfg, self.dist.world)
        self.schedule_offset = 0
        """Inner steps of earlier incarnations (from the resumed data position): the schedule goes on from there."""
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        """Made by :meth:`start`, once the resumed position is known."""
        net = self.ddp if self.ddp is not None else self.loss_module
        self.net = torch.compile(net) if cfg.learners.compile else net
        self._background = False
        """Whether states are written in the background (a process), or in line (a simulation: no threads)."""
        self._saved_event = threading.Event()
        """Set when no learner state is being written in the background (and the last one is recorded)."""
        self._saved_event.set()
        self._save_skipped = False
        """Whether the last due save was skipped because the one before was still being written."""
        self._stager: object | None = None
        """DCP's stager (a process's saves): copies the state to host memory on its own thread."""
        self._recorder: ThreadPoolExecutor | None = None
        """A process's saves are recorded (ledger row, old state deleted) on this thread of their own."""
        self._staged: Future | None = None
        """The copy of the state being saved: the parameters and AdamW's state change only once it is done."""
        self.encode_stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        """CUDA: the side stream the link encodes this learner's increments on, off the training stream."""
        self.dataset = build_dataset(cfg.data, cfg.model)
        self.batches_drawn = 0
        """Micro-batches this rank has drawn from its stream, over every incarnation: its data position."""
        self.incarnation = -1
        self.step_count = 0
        self.tokens_total = 0
        self._tokens_unsubmitted = 0
        self.last_loss: float | None = None
        """Moving average of the finite step losses (None before the first)."""
        self.loss_read = LateRead(late=self.device.type == "cuda")
        """How a step's loss reaches the host: one step late on a GPU, at once on a CPU."""
        self._unread_tokens: deque[float] = deque()
        """The learner's tokens of each trained step whose loss is not read yet (one on a GPU, none on a CPU)."""
        self.nonfinite_losses = 0
        """Steps whose loss was NaN or infinite."""
        self.last_step_s = 0.0
        self.last_tokens = 0
        self._busy_s = 0.0
        self._last_step_at = 0.0
        self._waiting_since: float | None = None
        self.timings: dict[str, float] = {}
        """Seconds of the training thread per span (agree, apply, train_step, send): the job summary's figures."""
        self.cost: ModelCost | None = None
        """Rank 0: the model's FLOPs per token and the device's peak, for the heartbeats' FLOP/s and MFU (set by whoever
        counted them; none is counted by default)."""

    # --- lifecycle ------------------------------------------------------------------------------

    @property
    def base(self) -> list[int]:
        return [f.base for f in self.fragments]

    @property
    def run_finished(self) -> bool:
        return self.link is not None and self.link.run_finished

    def start(self, now: float | None = None, *, ready_timeout_s: float | None = None) -> None:
        """Join the run: rank 0 fetches the newest global version of every fragment and registers a new
        incarnation (retrying for ``ready_timeout_s`` while version 0 is not out); every rank gets the
        incarnation (it seeds the data) and the saved AdamW state, and applies the global fragments."""
        resume = Resume()
        if self.link is not None:
            if ready_timeout_s is None:
                resume = self.link.join(self.clock() if now is None else now)
            else:
                resume = self.link.join_when_ready(ready_timeout_s, self.clock)
            self.incarnation = self.link.incarnation
        shared = self.dist.broadcast_object((self.incarnation, resume))
        self.incarnation, resume = int(shared[0]), shared[1]
        if resume.state_url:
            self.load_state(resume.state_url)
        self.batches_drawn = resume.data_batches
        self.schedule_offset = resume.data_batches // self.cfg.inner.grad_accum_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step + self.schedule_offset, self.cfg.inner, self.total_steps)
        )
        if resume.data_batches:
            log.info("learner %s rank %s resumes its data at micro-batch %s", self.id, self.dist.rank, resume.data_batches)
        self._batches = self.train_stream()
        if self.link is not None:
            self.link.set_cadence(self.first_cadence(self.clock() if now is None else now))
        self._receive(self._agree(want_stop=False))
        missing = [p for p, f in enumerate(self.fragments) if f.base < 0]
        if missing:
            raise RuntimeError(f"rank {self.dist.rank} did not receive fragments {missing} when joining")
        now = self.clock() if now is None else now
        self._last_step_at = now
        self.heartbeat(now, force=True)

    def first_cadence(self, now: float) -> Cadence:
        """Every H steps with the run's codec: where an adaptive learner starts, and what a fixed one keeps."""
        policy = self.link.cadence_policy if self.link is not None else None
        if policy is not None:
            return initial_cadence(policy, now)
        return Cadence(self.cfg.fragments.period, self.cfg.compression.codec,
                       "fixed (fragments.adaptive is off): every H steps with compression.codec", now)

    def start_background_io(self) -> None:
        """Processes: rank 0 uploads, polls and heartbeats on background threads from now on, and every rank writes
        its saved state in the background."""
        self._background = True
        self._stager = make_stager(self.device)
        self._recorder = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.id}-state")
        if self.link is not None:
            self.link.start_threads(self.heartbeat_stats)

    def stop(self) -> None:
        """Finish writing the state and the queued uploads, and send a last heartbeat (rank 0)."""
        if self.finish_saves(STATE_WRITE_TIMEOUT_S):
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._recorder is not None:
                self._recorder.shutdown()
                self._recorder = None
        if self.link is not None:
            self.link.stop(self.heartbeat_stats)

    def train_stream(self) -> Iterator[Batch]:
        """Shard ``index * world + rank`` of ``num_learners * world`` (disjoint per rank), from the
        data position: a restarted learner goes on where its last registered submission left off."""
        return self.dataset.train_batches(
            self.index * self.dist.world + self.dist.rank,
            self.num_learners * self.dist.world,
            self.cfg.learners.batch_size,
            seed=self.cfg.seed * 1_000_003,
            start_batch=self.batches_drawn,
        )

    def run(self, stop: Callable[[], bool], max_steps: int | None = None, after_step: Callable[[StepReport], None] | None = None) -> None:
        """Step until any rank is stopped, rank 0 sees the run finish, or ``max_steps`` — all ranks together."""
        while True:
            want_stop = stop() or self.run_finished or (max_steps is not None and self.step_count >= max_steps)
            report = self.step(want_stop=want_stop)
            if report.stopped:
                self._make_up_skipped_save()
                return
            if report.waiting and self.link is not None:
                self.link.wait_for_awaited(1.0)
            if after_step is not None:
                after_step(report)

    # --- one step -------------------------------------------------------------------------------

    def step(self, now: float | None = None, *, want_stop: bool = False) -> StepReport:
        """Agree with the other ranks, apply arrived fragments, run one inner step, send the fragments that are due."""
        now = self.clock() if now is None else now
        every = self.link.choose(now, self.last_step_s).every if self.link is not None else 0
        control = self._agree(want_stop, every)
        if control.stop:
            if self.link is not None and control.arrived:
                self.link.put_back(control.arrived)
            return StepReport(self.step_count, None, 0, stopped=True)
        received = self._receive(control)
        if control.awaiting:
            if self._waiting_since is None:
                self._waiting_since = now
            return StepReport(self.step_count, None, 0, received=received, waiting=True)
        if self._waiting_since is not None:
            # Time spent waiting for a merge (overlap 0) is not part of a step.
            self._last_step_at += now - self._waiting_since
            self._waiting_since = None
        t0 = time.perf_counter()
        loss, tokens = self.train_step()
        compute_s = time.perf_counter() - t0
        # A step lasts from its start to the next one's: slower hardware, I/O on this thread and
        # pacing all count, which is what stragglers and goodput are judged on.
        period = now - self._last_step_at
        step_s = period if period > 0 else compute_s
        self._last_step_at = now
        self.step_count += 1
        self.tokens_total += tokens
        self._tokens_unsubmitted += tokens
        self.last_tokens = tokens
        if loss is not None and math.isfinite(loss):
            self.last_loss = loss if self.last_loss is None else 0.9 * self.last_loss + 0.1 * loss
        elif loss is not None:
            self._nonfinite_loss(loss)
        self.last_step_s = step_s if self.last_step_s == 0 else 0.8 * self.last_step_s + 0.2 * step_s
        self._busy_s += step_s
        self.tally.steps += 1
        self.tally.tokens += tokens
        sent = self.due(control.every)
        with span("learner.send", into=self.timings):
            for p in sent:
                self.send(p, now)
        every = self.cfg.learners.save_optimizer_every
        if every and self.step_count % every == 0:
            self.save_state()
        return StepReport(self.step_count, loss, tokens, submitted=sent, received=received, compute_s=compute_s)

    def _nonfinite_loss(self, loss: float) -> None:
        """Count a NaN or infinite step loss (kept out of the moving average, which would stay NaN for good) and say
        so: rank 0 logs an ERROR on the 1st, 2nd, 4th, 8th… such step, so a diverged learner does not flood its log."""
        self.nonfinite_losses += 1
        n = self.nonfinite_losses
        if self.link is not None and n & (n - 1) == 0:
            log.error("learner %s step %s: loss is %s (%s non-finite step loss%s so far; the synchronizer rejects "
                      "non-finite sends)", self.id, self.step_count - int(self.loss_read.late), loss, n, "" if n == 1 else "es")

    def due(self, every: int) -> list[int]:
        """Fragments to send after this step: each every ``every`` steps (a multiple of H, the sends spread
        out), and never two sends of one fragment fewer than H steps apart (the period may just have shrunk)."""
        H = self.cfg.fragments.period
        k = max(1, every // H)
        due = due_fragments(self.step_count, len(self.fragments), k * H, stride=k)
        return [p for p in due if self.fragments[p].last_sent is None or self.step_count - self.fragments[p].last_sent >= H]

    def train_step(self) -> tuple[float | None, int]:
        """One (DDP or FSDP) AdamW step over ``grad_accum_steps`` micro-batches of this rank's stream: (the learner
        loss of the step read now, see ``StepReport.loss``; the learner tokens of this step), summed over ranks and
        micro-batches."""
        accum = self.cfg.inner.grad_accum_steps
        with span("learner.train_step", into=self.timings):
            self.optimizer.zero_grad(set_to_none=True)
            # The token-weighted loss is summed on the device and read after the step is queued (on a GPU one step
            # later): a read per micro-batch would make the host wait for each backward before queueing the next forward.
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            tokens = 0.0
            for micro in range(accum):
                batch = next(self._batches)
                self.batches_drawn += 1
                inputs = batch.inputs.to(self.device, non_blocking=True)
                targets = batch.targets.to(self.device, non_blocking=True)
                # DDP all-reduces (FSDP reduce-scatters) gradients on the last micro-batch only.
                last = micro == accum - 1
                if self.layout.parallelism != "ddp":
                    self.model.set_requires_gradient_sync(last)
                with contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync():
                    loss = self.net(inputs, targets, batch.tokens)
                    (loss / accum if accum > 1 else loss).backward()
                loss_sum += loss.detach().double() * batch.tokens
                tokens += batch.tokens
            fault_point("learner.mid_step")
            # Gradients are already averaged over ranks (identical everywhere, or sharded DTensors whose norm
            # clip_grad_norm_ reduces over the shards).
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
            self._await_staging()
            self.optimizer.step()
            self.scheduler.step()
            read = self.loss_read.put(loss_sum)
            # Every rank reads late or at once alike, so the sums always pair the same step's losses.
            stats = torch.tensor([0.0 if read is None else read, tokens], dtype=torch.float64)
            total, tokens = self.dist.all_reduce_sum(stats).tolist()
        self._unread_tokens.append(tokens)
        return (None if read is None else total / self._unread_tokens.popleft()), int(tokens)

    @property
    def lr(self) -> float:
        """The inner learning rate of the next step."""
        return self.optimizer.param_groups[0]["lr"]

    # --- agreeing and receiving -----------------------------------------------------------------

    def _agree(self, want_stop: bool, every: int = 0) -> Control:
        """One small all-reduce: any rank may stop; rank 0 says what to apply, what is awaited and the send period."""
        with span("learner.agree", into=self.timings):
            arrived: dict[int, Arrival] = {}
            awaiting: set[int] = set()
            if self.link is not None:
                arrived, awaiting = self.link.take_arrivals()
            if self.dist.world == 1:
                # Nothing to agree with: what arrived is applied as it is, with no tensor built or read each step.
                return Control(stop=want_stop, apply=sorted((p, version) for p, (version, _) in arrived.items()),
                               awaiting=awaiting, arrived=arrived, every=every or self.cfg.fragments.period)
            P = len(self.fragments)
            vec = torch.zeros(2 + 3 * P, dtype=torch.int64)
            vec[0] = int(want_stop)
            vec[1 + 3 * P] = every
            if self.link is not None:
                for p, (version, _tensors) in arrived.items():
                    vec[1 + p] = 1
                    vec[1 + P + p] = version
                for p in awaiting:
                    vec[1 + 2 * P + p] = 1
            values = self.dist.all_reduce_sum(vec).tolist()
        return Control(
            stop=values[0] > 0,
            apply=[(p, values[1 + P + p]) for p in range(P) if values[1 + p]],
            awaiting={p for p in range(P) if values[1 + 2 * P + p]},
            arrived=arrived,
            every=values[1 + 3 * P] or self.cfg.fragments.period,
        )

    def _receive(self, control: Control) -> list[int]:
        """Fold the agreed global fragments into the parameters on every rank.

        ``merge.on_receipt``: overwrite (θ ← G), blend (θ ← (1 − α)·θ + α·G) — both reset the
        counters, the progress since the last send being discarded or halved — or rebase
        (θ ← θ + (G − S), S ← G): the unsent progress θ − S is carried onto the new version and
        the counters are kept, since the next send (S − θ) still carries those steps. Increments
        whose upload failed wait in the link (as if in flight): every mode sends them with the next
        send, none applies them locally."""
        if not control.apply:
            return []
        with span("learner.apply", into=self.timings):
            mode = self.cfg.merge.on_receipt
            alpha = self.cfg.merge.blend_alpha if mode == "blend" else 1.0
            # base and c_steps are the same on every rank, so they all agree on which fragments rebase.
            rebase = {p for p, _ in control.apply if rebases(mode, self.fragments[p].base, self.fragments[p].c_steps)}
            incoming = self._incoming(control)
            self._await_staging()
            for p, version in control.apply:
                self.fragments[p].receive(version, incoming, rebase=p in rebase, alpha=alpha)
        return [p for p, _ in control.apply]

    def _incoming(self, control: Control) -> Tensors:
        """The arrived global fragments, whole, on every rank's device: rank 0 broadcasts them as one flat buffer."""
        names = [n for p, _ in control.apply for n in self.fragments[p].keys]
        shapes = [s for p, _ in control.apply for s in self.fragments[p].shapes]
        if self.link is not None:
            host = {n: t for p, _ in control.apply for n, t in control.arrived[p][1].items()}
            if self.dist.world == 1:
                # Arrivals are decoded in host memory (pinned for a GPU learner) or already on its device
                # (learners.decode_on_device); it folds them in on its device.
                return host if self.device.type == "cpu" else {n: t.to(self.device, non_blocking=True) for n, t in host.items()}
            parts = [host[n].reshape(-1).to(torch.float32) for n in names]
            if parts[0].device != self.device:
                flat = torch.empty(sum(t.numel() for t in parts), dtype=torch.float32, pin_memory=self.device.type == "cuda")
                flat = torch.cat(parts, out=flat).to(self.device, non_blocking=True)
            else:
                flat = torch.cat(parts)
        else:
            flat = torch.empty(sum(s.numel() for s in shapes), dtype=torch.float32, device=self.device)
        self.dist.broadcast(flat)
        return {n: t.view(s) for n, t, s in zip(names, flat.split([s.numel() for s in shapes]), shapes)}

    # --- sending --------------------------------------------------------------------------------

    def send(self, p: int, now: float) -> None:
        """Every rank: the increment of its rows of fragment ``p`` since the last send, on the training device
        (rank 0 gathers its shard group's rows); rank 0 queues it for the link to encode (on a side stream on
        GPUs) and upload. Only the encoded bytes ever reach host memory."""
        frag = self.fragments[p]
        frag.last_sent = self.step_count
        with span("learner.stage"):
            rank0 = self.link is not None
            rows, c_steps, c_tokens = frag.take_increment(rank0 or (self.layout.sharded and self.layout.gathers))
            if rows is None:
                return
            whole = gather_pieces(rows, frag.keys, frag.shapes, frag.sizes, self.layout, rank0)
            if whole is None:
                return
            increment = Increment(whole, *self._ready())
            # The new tokens a send accounts for are at most those its update carries (the synchronizer holds
            # it to that): with steps that send nothing (H > P, a longer period) the rest waits for the next send.
            tokens_new = min(self._tokens_unsubmitted, c_tokens)
            out = Outgoing(
                fragment=p, base_version=frag.base, parts=[increment], c_steps=c_steps, c_tokens=c_tokens,
                tokens_new=tokens_new, tokens_total=self.tokens_total, step=self.step_count, created_at=now,
                data_batches=self.batches_drawn,
            )
            self._tokens_unsubmitted -= tokens_new
            self.link.submit(out, await_merge=self.cfg.fragments.overlap == 0)

    def _ready(self) -> tuple[object | None, object | None]:
        """CUDA: an event after the work queued so far on the training stream, and the stream to encode on."""
        if self.encode_stream is None:
            return None, None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event, self.encode_stream

    # --- learner state -------------------------------------------------------------------------

    def save_state(self) -> None:
        """Every rank, together: AdamW's state (and the model's) through torch.distributed.checkpoint into the
        learner's own prefix of its store, each rank writing its own shards. In a process (after
        :meth:`start_background_io`) the state is copied to host memory here and written in the background; once
        written, rank 0 points the learner's row at it. While a save is still being written no other starts (the
        ranks agree). A simulation, which has no threads, saves in line. A failed save only costs a colder restart."""
        busy = torch.tensor([int(not self._saved_event.is_set())], dtype=torch.int64)
        if self.dist.all_reduce_sum(busy).item():
            log.info("learner %s: the previous state is still being written; no save at step %s", self.id, self.step_count)
            self._save_skipped = True
            return
        self._save_skipped = False
        url = self.dist.broadcast_object(self.link.state_url(self.step_count) if self.link is not None else None)
        self._saved_event.clear()
        try:
            with span("learner.save_state", into=self.timings):
                if self._stager is not None and self.device.type == "cuda":
                    # The stager copies on a stream of its own that does not wait for the training stream: the
                    # optimizer step just queued must be done before the copy starts.
                    torch.cuda.current_stream(self.device).synchronize()
                futures = save_state(
                    url, self.model, self.optimizer, {"step": self.step_count, "data_batches": self.batches_drawn},
                    process_group=self.dist.checkpoint, storage_options=self.cfg.storage.fsspec_options(),
                    background=self._background, stager=self._stager,
                )
        except Exception as err:  # noqa: BLE001 - a store that is down must not take the learner with it
            self._saved_event.set()
            log.warning("learner %s rank %s: saving its state failed (%s)", self.id, self.dist.rank, redact_url(str(err)))
            return
        if futures is None:
            writing: Future = Future()
            writing.set_result(None)
        else:
            self._staged, writing = futures
        writing.add_done_callback(lambda done: self._written(url, done))

    def _await_staging(self) -> None:
        """Before the parameters or AdamW's state change: the copy of a state being saved must be done (a failed copy
        fails the write, which says so)."""
        if self._staged is not None:
            self._staged.exception()
            self._staged = None

    def _make_up_skipped_save(self) -> None:
        """At a stop all ranks agreed on: if the last due save was skipped (its predecessor was still being written),
        save now, so the job leaves its newest state rather than one a few saves old. Every rank holds the same flag
        (it follows an all-reduce), so the collective runs on all of them or none."""
        if not self._save_skipped:
            return
        self.finish_saves(STATE_WRITE_TIMEOUT_S)
        self.save_state()

    def _written(self, url: str, done: Future) -> None:
        """A save's write ended: in a process it is recorded on the recorder thread, never on the training thread
        (where a write already done when its callback is added would run it: a ledger transaction and a delete in
        the store between two steps) nor on DCP's; a simulation records it in line."""
        if self._recorder is None:
            self._saved(url, done)
        else:
            self._recorder.submit(self._saved, url, done)

    def _saved(self, url: str, done: Future) -> None:
        """A save ended: rank 0 records it, or every rank logs why it failed."""
        try:
            err = done.exception()
            if err is not None:
                log.warning("learner %s rank %s: writing its state failed (%s)", self.id, self.dist.rank, redact_url(str(err)))
            elif self.link is not None:
                self.link.state_saved(url)
        finally:
            self._saved_event.set()

    def finish_saves(self, timeout_s: float | None = None) -> bool:
        """Wait until a state being written in the background is written and recorded (a stop, a test that
        restarts the learner); whether none is still being written."""
        return self._saved_event.wait(timeout_s)

    def load_state(self, url: str) -> None:
        """Every rank, together: AdamW's state from the newest save, resharded to this job's ranks (it may have
        had another world size or parallelism). The model's parameters are taken from the global versions next."""
        try:
            load_state(url, self.model, self.optimizer, process_group=self.dist.checkpoint,
                       storage_options=self.cfg.storage.fsspec_options())
            log.info("learner %s rank %s resumes AdamW from %s", self.id, self.dist.rank, redact_url(url))
        except Exception as err:  # noqa: BLE001 - an unreadable state only costs a colder restart
            log.warning("learner %s rank %s: %s; starting AdamW afresh", self.id, self.dist.rank, redact_url(str(err)))

    # --- heartbeats and figures -----------------------------------------------------------------

    def heartbeat_stats(self) -> HeartbeatStats:
        """This learner's progress since the last heartbeat (its busy seconds are handed over once)."""
        busy, self._busy_s = self._busy_s, 0.0
        tokens_per_s, flops, mfu = self.throughput()
        return HeartbeatStats(
            step=self.step_count, tokens=self.tokens_total, loss=self.last_loss, tokens_per_s=tokens_per_s,
            step_time_s=self.last_step_s, busy_s=busy, model_flops_per_s=flops, mfu=mfu,
        )

    def throughput(self) -> tuple[float, float | None, float | None]:
        """Tokens/s at the step's moving-average time, and one device's model FLOP/s and MFU at that rate (None where
        :attr:`cost` does not know them): what heartbeats, the progress line and /metrics all report."""
        step_s = self.last_step_s
        if step_s <= 0:
            return 0.0, None, None
        tokens_per_s = self.last_tokens / step_s
        if self.cost is None:
            return tokens_per_s, None, None
        return tokens_per_s, self.cost.per_device_flops(tokens_per_s, self.dist.world), self.cost.mfu(tokens_per_s, self.dist.world)

    def heartbeat(self, now: float, force: bool = False) -> None:
        """Rank 0: record progress (at most every ``learners.heartbeat_s`` unless forced)."""
        if self.link is not None:
            self.link.heartbeat(now, self.heartbeat_stats, force=force)
