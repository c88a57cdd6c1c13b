"""Where a learner computes: device choice, mixed precision, and copies off the training stream.

Everything here has a CPU path that runs (and is tested) on any machine, and a CUDA path for
accelerators. The CUDA paths are written against the public ``torch.cuda`` API and are tested only
where a GPU is present (the tests that need one say so when they skip)."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from ddiloco.platform.config import ConfigError


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto``: this rank's own GPU (``cuda:<local_rank>``) when CUDA is present, else the CPU.

    ``cuda`` insists on a GPU (a ConfigError when there is none); ``cpu`` always means the CPU. A rank whose
    ``LOCAL_RANK`` has no GPU of its own is refused: ranks sharing a GPU would run out of memory or stop NCCL."""
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"learners.device must be auto, cpu or cuda, got {name!r}")
    if name == "cpu" or (name == "auto" and not cuda_available()):
        return torch.device("cpu")
    if not cuda_available():
        raise ConfigError("learners.device is 'cuda' but torch sees no CUDA device on this machine (use auto or cpu)")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"local rank {local_rank} has no GPU of its own: torch sees {count} on this machine; give the learner "
            "one GPU per rank (learners.nproc_per_node; a pod's nvidia.com/gpu) or set learners.device: cpu"
        )
    return torch.device("cuda", local_rank)


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
class Increment:
    """An outer-gradient increment of one fragment (whole pieces by key) where the parameters live.

    On a GPU it is still being computed on the training stream when it is handed over: ``ready`` is an event
    recorded after it, and ``stream`` the side stream the link encodes it on, so encoding never queues behind
    (or ahead of) training kernels and only encoded bytes are copied to host memory."""

    tensors: dict[str, torch.Tensor]
    ready: object | None = None
    stream: object | None = None

    def resolve(self) -> dict[str, torch.Tensor]:
        """The tensors, usable on the calling thread's current stream (which waits for them on a GPU)."""
        if self.ready is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self.ready)  # type: ignore[attr-defined]
        return self.tensors

    def stream_context(self) -> AbstractContextManager:
        """Where to encode it: its side stream on a GPU, nowhere special on a CPU."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()  # type: ignore[arg-type]


def fold_increments(parts: list[Increment | dict[str, torch.Tensor]]) -> Increment | dict[str, torch.Tensor]:
    """Increments of one fragment, oldest first, as one: summed in that order (the order the encode would sum them
    in, so the bytes are the same) where they live, on a GPU on the calling thread's stream, with an event after the
    sum for the encode stream to wait on."""
    if len(parts) == 1:
        return parts[0]
    tensors = [part.resolve() if isinstance(part, Increment) else part for part in parts]
    keys = list(tensors[0])
    total = torch._foreach_add([tensors[0][k] for k in keys], [tensors[1][k] for k in keys])
    for more in tensors[2:]:
        torch._foreach_add_(total, [more[k] for k in keys])
    stream = next((part.stream for part in parts if isinstance(part, Increment) and part.stream is not None), None)
    if stream is None:
        return Increment(dict(zip(keys, total)))
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(stream.device))  # type: ignore[attr-defined]
    return Increment(dict(zip(keys, total)), ready, stream)


class LateRead:
    """A step's scalar (its loss sum) read without making the host wait for that step.

    Late (a GPU learner): the value is copied to pinned host memory behind the step's kernels and read at the next
    :meth:`put`, by when its step is done, so the host stays one step ahead of the GPU and its own work between steps
    (the platform's sends, receipts, bookkeeping) overlaps the GPU's instead of leaving it idle. A read at once
    would make the host wait for the whole step it just queued. Not late (a CPU, where nothing is queued): at once."""

    def __init__(self, late: bool) -> None:
        self.late = late
        self._pending: tuple[torch.Tensor, object | None] | None = None

    def put(self, value: torch.Tensor) -> float | None:
        """Hand over this step's value; the value read now: this step's, or when late the step before's (None at
        the first step)."""
        if not self.late:
            return float(value)
        host = value.detach().to("cpu", non_blocking=True)
        done = None
        if value.is_cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(value.device))
        previous, self._pending = self._pending, (host, done)
        if previous is None:
            return None
        host, done = previous
        if done is not None:
            done.synchronize()  # type: ignore[attr-defined]
        return float(host)
