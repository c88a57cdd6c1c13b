"""A learner's ranks: this rank, the world, the training device and the process groups.

A learner may be a data-parallel job of several ranks launched by torchrun (``launch.py``); to the
rest of the platform it is one learner and rank 0 is its only voice. World size 1 is the same code
with no process group: every collective below is skipped when ``world == 1``."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddiloco.learner_worker.device import backend_for, set_device

log = logging.getLogger("ddiloco.learner")

TIMEOUT_ENV = "DDILOCO_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
"""Longest a collective may wait for a peer before the rank gives up (and the job goes down)."""


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
    """A learner's ranks and the process groups they talk over."""

    rank: int
    world: int
    device: torch.device
    control: Any = None
    """gloo group for the per-step control vector and the loss/token sums (CPU tensors)."""
    bootstrap: Any = None
    """gloo group with a long timeout: the other ranks wait on it while rank 0 waits for version 0."""
    checkpoint: Any = None
    """gloo group of the learner state's saves, which run on a background thread (nothing else uses it)."""

    @classmethod
    def single(cls, device: torch.device | None = None) -> Dist:
        """One rank, no process group."""
        return cls(rank=0, world=1, device=device or torch.device("cpu"))

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a small CPU tensor over the ranks (in place; a no-op for one rank)."""
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.control)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor on every rank, on the training device's group (a no-op for one rank)."""
        if self.world > 1:
            dist.broadcast(tensor, src=0)
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's object on every rank, over the long-timeout bootstrap group (in memory, never stored)."""
        if self.world == 1:
            return obj
        payload = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(payload, src=0, group=self.bootstrap)
        return payload[0]


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
    checkpoint = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), device=device, control=control, bootstrap=bootstrap,
                checkpoint=checkpoint)


def shutdown_dist(d: Dist, *, together: bool = False) -> None:
    """Leave the process group. ``together`` (a clean stop): wait for every rank first, so no rank
    tears down its group while a peer is still in its own stop (gloo can abort the later one)."""
    if d.world > 1 and dist.is_initialized():
        try:
            if together and d.device.type == "cpu":
                dist.monitored_barrier(timeout=timedelta(seconds=30))  # gloo: a peer that never comes is named
            elif together:
                dist.barrier()
            dist.destroy_process_group()
        except Exception:
            log.debug("leaving the process group failed", exc_info=True)


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Linux: get ``sig`` when the launcher dies, so no rank outlives a SIGKILLed torchrun agent."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def ensure_process_group(d: Dist) -> None:
    """A process group for a one-rank learner that shards (FSDP2 needs a device mesh): a private group of one
    rank over an in-memory store. A multi-rank learner already has its group from :func:`init_dist`."""
    if d.world == 1 and not dist.is_initialized():
        # A CPU backend beside NCCL: the learner's state is saved through this group from a background thread.
        backend = "cpu:gloo,cuda:nccl" if d.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
