"""Where a learner computes: device choice, mixed precision, and copies off the training stream.

Everything here has a CPU path that runs (and is tested) on any machine, and a CUDA path for
accelerators. The CUDA paths are written against the public ``torch.cuda`` API and are tested only
where a GPU is present (the tests that need one say so when they skip)."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from ddiloco.platform.config import ConfigError


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto``: this rank's GPU (``cuda:<local_rank mod GPUs>``) when CUDA is present, else the CPU.

    ``cuda`` insists on a GPU (a ConfigError when there is none); ``cpu`` always means the CPU."""
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"learners.device must be auto, cpu or cuda, got {name!r}")
    if name == "cpu" or (name == "auto" and not cuda_available()):
        return torch.device("cpu")
    if not cuda_available():
        raise ConfigError("learners.device is 'cuda' but torch sees no CUDA device on this machine (use auto or cpu)")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for ranks on ``device``: NCCL for GPUs, gloo for CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def autocast(device: torch.device) -> AbstractContextManager:
    """bf16 autocast on CUDA (fp32 master weights and optimizer state); a no-op elsewhere.

    On the CPU, bf16 matmuls are slower than fp32 on most hosts and change results, so the CPU path
    stays in full precision (and bit-for-bit comparable with the single-process learner)."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def set_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


@dataclass
class Staged:
    """Host copies of some tensors, possibly still being filled by a side stream."""

    tensors: dict[str, torch.Tensor]
    event: object | None = None
    """A ``torch.cuda.Event`` recorded after the copies; None when the copies are already done."""
    _done: bool = field(default=False, repr=False)

    def ready(self) -> bool:
        return self.event is None or self._done or bool(self.event.query())  # type: ignore[attr-defined]

    def wait(self) -> dict[str, torch.Tensor]:
        """Block (this host thread only) until the copies are done; returns them."""
        if self.event is not None and not self._done:
            self.event.synchronize()  # type: ignore[attr-defined]
            self._done = True
        return self.tensors


class HostStager:
    """Copies tensors to host memory without stalling the training stream.

    CPU: a plain clone (the tensors are already in host memory; it takes as long as a memcpy).
    CUDA: a device-to-device snapshot on the training stream (fast: device bandwidth), then a
    non-blocking copy of that snapshot into pinned host memory on a side stream. The training stream
    never waits for the host copy; whoever needs the host tensors calls :meth:`Staged.wait` — the
    learner's upload thread does, off the training thread. Pinned buffers come from PyTorch's caching
    host allocator, so repeated sends reuse them without fresh page-locking."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def stage(self, tensors: dict[str, torch.Tensor]) -> Staged:
        if self.stream is None:
            return Staged({n: t.detach().to("cpu", copy=True) for n, t in tensors.items()})
        main = torch.cuda.current_stream(self.device)
        with torch.no_grad():
            # The snapshot is taken in stream order, after the optimizer step that produced the values.
            snap = {n: t.detach().clone() for n, t in tensors.items()}
        self.stream.wait_stream(main)
        host: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self.stream):
            for n, t in snap.items():
                host[n] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                host[n].copy_(t, non_blocking=True)
                # The snapshot's memory must not be reused before the side stream has read it.
                t.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return Staged(host, event)
