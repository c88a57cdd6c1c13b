"""A learner's state — model, AdamW and a few small extras — saved and loaded with torch.distributed.checkpoint.

One checkpoint is one directory under any fsspec URL (``file://``, ``memory://``, ``s3://``…), written by
every rank of the learner collectively: each rank writes its own shards (an FSDP2 model's DTensors, or one
copy of the replicated tensors of a plain or DDP model) and the coordinator writes DCP's ``.metadata``
last, so a checkpoint is complete exactly when ``.metadata`` exists (:func:`is_complete`). Loading
reshards: a checkpoint saved by two FSDP2 ranks loads into one plain rank and back.

What is saved, all of it tensors:

- ``model.<fqn>``: the parameters and buffers, as ``get_state_dict`` gives them (sharded for FSDP2); a tied
  weight once, under its first name (loading gives it to every name it has);
- ``optim.state.<fqn>.<exp_avg|exp_avg_sq|step>``: the optimizer's per-parameter state. Not its
  ``param_groups``: those are hyperparameters (lr, betas, weight decay), which the config and the lr
  schedule own, and DCP would store them as pickles;
- ``extra.int.<name>`` / ``extra.tensor.<name>``: the caller's extras (data position, step…).

Nothing read back is unpickled. DCP's default files are ``torch.save`` archives indexed by a pickled
``.metadata``; here every rank's data file is safetensors (DCP's ``SerializationFormat.SAFETENSORS``,
each tensor's place in the whole written as JSON in the file's header), the coordinator's last write is
a small JSON marker (:data:`MARKER`) in place of ``.metadata``, and a load rebuilds DCP's index from
the safetensors headers (DCP's own ``HuggingFaceStorageReader``). safetensors can only be read from
local files, so a load copies the checkpoint's files to a temporary directory first (once per
incarnation).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from fsspec.core import url_to_fs
from torch import nn

from ddiloco.platform.redact import redact_url
from ddiloco.platform.store import fs_options

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.checkpoint.metadata import Metadata

# torch.distributed.checkpoint is imported inside the functions below, not here: importing it pulls in
# torch.distributed.tensor and through it torch.fx's symbolic shapes and sympy, 3.0-3.4 s on this
# machine's 2 shared cores (python -X importtime, on top of torch, fsspec and DDP; this module alone
# takes about 12 ms). Every process that imports it would pay that, the ones that never save included.

Extras = Mapping[str, int | torch.Tensor]
"""Small learner state saved beside the model: ints (a step, a data position) or tensors, by name."""

MARKER = "ddiloco-state.json"
"""Written by the coordinator after every rank's data: a checkpoint is complete exactly when it exists."""
STATE_FORMAT = "ddiloco-learner-state/1"
"""DCP's index of a checkpoint; written last (as ``.metadata.tmp``, then renamed), so it marks completion."""


class StateError(RuntimeError):
    """A learner state could not be saved or loaded; the message names the URL and each failing rank's error."""


class StateMissing(StateError, FileNotFoundError):
    """No complete learner state at the URL (nothing there, or a save that never wrote its ``.metadata``)."""


class StateRefused(StateError, ValueError):
    """A learner state whose ``.metadata`` holds something other than DCP's own tensor index."""


@contextlib.contextmanager
def _dcp_errors(doing: str, url: str) -> Iterator[None]:
    """DCP's own errors as a :class:`StateError`, quietly in a single process.

    DCP gathers every rank's failure into a ``CheckpointException``, which is a ``BaseException``: an
    ``except Exception`` of the caller (a learner that starts AdamW afresh when its state is unreadable)
    would not see it."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        # With no process group, DCP warns that it assumes a single process: that is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            yield
        except CheckpointException as err:
            ranks = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(err.failures.items()))
            raise StateError(f"{doing} the learner state at {redact_url(url)} failed: {ranks}") from err


def _fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    return url_to_fs(url, **fs_options(url, storage_options))


def is_complete(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether a whole learner state lies at ``url``: DCP writes ``.metadata`` after every rank's data."""
    fs, path = _fs(url, storage_options)
    return bool(fs.exists(f"{path.rstrip('/')}/{MARKER}"))


def save_state(
    url: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extras: Extras | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
    background: bool = False,
    stager: Any | None = None,
) -> tuple[Future, Future] | None:
    """Save ``model``, ``optimizer``'s per-parameter state and ``extras`` as one checkpoint at ``url``.

    Collective: every rank of ``process_group`` (the world group by default; none at all in a single
    process) calls it with the same ``url`` and ``extras``. ``model`` may be plain, DDP-wrapped or FSDP2
    (``fully_shard``); an FSDP2 rank writes only its shards. The URL should be new for each save (a key
    like ``{run}/learners/{learner}/state/i{incarnation}-s{step}``): a complete state there is never
    overwritten (``FileExistsError``), an incomplete one (a save that died) is written over. The save
    is complete once :func:`is_complete` says so. Extras are ints or tensors under names without dots;
    a tensor is saved as one copy, so it must be equal on every rank.

    ``background``: the state is copied to host memory and written by a thread of DCP's (``async_save``); it
    returns two futures, ``(staged, written)``: the copy is done, the write is done (its exception, if any, is
    DCP's). Without ``stager`` the copy is made here (``staged`` is already done); with one (:func:`make_stager`)
    it is made on the stager's thread, and the caller must change neither the model's parameters nor AdamW's state
    until ``staged`` is done. The process group must be a CPU (gloo) group that nothing else uses while the write
    runs, and a caller starts no other save before ``written`` is done."""
    from torch.distributed.checkpoint import async_save, save

    encoded = _encode_extras(extras or {})
    if is_complete(url, storage_options):
        # A complete state is immutable, like every blob of the store: writing over it would leave the
        # old .metadata indexing half-rewritten data files until the new one lands.
        raise FileExistsError(f"a complete learner state is already at {redact_url(url)}; a saved state is never overwritten")
    model_state, optim_state = _model_state(model, optimizer)
    state: dict[str, Any] = {"model": _without_aliases(model_state)[0], "extra": encoded}
    if optimizer is not None:
        state["optim"] = {"state": optim_state["state"]}
    writer = _writer(url, storage_options)
    with _dcp_errors("saving", url):
        if background:
            response = async_save(state, storage_writer=writer, process_group=process_group, async_stager=stager)
            if hasattr(response, "staging_completion"):
                return response.staging_completion, response.upload_completion
            staged: Future = Future()
            staged.set_result(None)
            return staged, response
        save(state, storage_writer=writer, process_group=process_group)
    return None


def make_stager(device: torch.device) -> Any:
    """DCP's stager that copies a learner's state to host memory on a thread of its own, so a save costs the training
    thread almost nothing: on a GPU into pinned buffers kept from one save to the next, with non-blocking copies on a
    stream of its own. The caller closes it after its last save."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device.type == "cuda"
    options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda)
    # The stager makes its stream on the current device, from this (the training) thread, as DCP asks.
    with torch.cuda.device(device) if cuda else contextlib.nullcontext():
        return DefaultStager(options)


def load_state(
    url: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, int | torch.Tensor]:
    """Load the checkpoint at ``url`` into ``model`` (and ``optimizer``'s state); returns the saved extras.

    Collective like :func:`save_state`. Reshards: the checkpoint may come from any number of ranks and
    any wrapping (plain, DDP, FSDP2) of the same model. The optimizer keeps its own hyperparameters
    (``param_groups``); ``exp_avg``, ``exp_avg_sq`` and ``step`` of every parameter come from the
    checkpoint. Raises :class:`StateMissing` when the state at ``url`` is absent or incomplete,
    :class:`StateRefused` when its files are not this format's, and :class:`StateError` when it
    does not fit the model (a tensor missing, another shape)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    # Every rank looks before any collective, and all see the same store: they raise together.
    if not is_complete(url, storage_options):
        raise StateMissing(f"no complete learner state at {redact_url(url)} (no {MARKER}: never saved, or the save did not finish)")
    with _local_reader(url, storage_options) as reader:
        try:
            extras = _extras_like(reader.read_metadata())
        except Exception as err:  # a file that is not safetensors, or a header that does not parse
            raise StateRefused(f"{redact_url(url)}: unreadable data file ({type(err).__name__}: {err})") from None
        model_state, optim_state = _model_state(model, optimizer)
        kept, aliases = _without_aliases(model_state)
        state: dict[str, Any] = {"model": kept, "extra": extras}
        if optimizer is not None:
            state["optim"] = {"state": optim_state["state"]}
        with _dcp_errors("loading", url):
            load(state, storage_reader=reader, process_group=process_group)
    state["model"].update({alias: state["model"][name] for alias, name in aliases.items()})
    # A tensor the model or optimizer has and the checkpoint lacks is an error (DCP's default planner),
    # not a silent skip; set_*_state_dict are strict by default as well.
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        optim_state = {"state": state["optim"]["state"], "param_groups": optim_state["param_groups"]}
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_state)
    return _decode_extras(state["extra"])


# --- state dicts and extras ----------------------------------------------------------------------


def _model_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state dict, optimizer state dict) by FQN: sharded DTensors for FSDP2, full tensors otherwise.

    For a fresh optimizer ``get_state_dict`` first takes one step with zero gradients and lr 0 so that
    AdamW's state exists to load into; the parameters do not move."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return get_model_state_dict(model), {}
    return get_state_dict(model, optimizer)


def _without_aliases(model_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The model state with each tensor once, and the names left out mapped to the name kept.

    A tied weight (a language model's output layer sharing its embedding's matrix) is one parameter under two
    names, and safetensors refuses to write one memory twice; the optimizer already keeps one state for it."""
    from torch.distributed.tensor import DTensor

    kept: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, value in model_state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        if not isinstance(local, torch.Tensor) or local.numel() == 0:
            kept[name] = value
            continue
        where = (local.device, local.dtype, local.untyped_storage().data_ptr(), local.storage_offset(),
                 tuple(local.shape), tuple(local.stride()))
        if where in seen:
            aliases[name] = seen[where]
        else:
            seen[where] = name
            kept[name] = value
    return kept, aliases


def _encode_extras(extras: Extras) -> dict[str, dict[str, torch.Tensor]]:
    ints: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, value in extras.items():
        if not name or "." in name:
            raise ValueError(f"learner state extra {name!r}: a name must be non-empty and without dots (DCP joins keys with dots)")
        if isinstance(value, bool) or not isinstance(value, int | torch.Tensor):
            raise TypeError(f"learner state extra {name!r} is {type(value).__name__}: only ints and tensors are saved (never pickles)")
        if isinstance(value, int):
            ints[name] = torch.tensor(value, dtype=torch.int64)
        else:
            tensors[name] = value.detach().cpu()
    return {"int": ints, "tensor": tensors}


def _extras_like(metadata: Metadata) -> dict[str, dict[str, torch.Tensor]]:
    """Empty tensors to load the saved extras into, shaped as the checkpoint's index says."""
    out: dict[str, dict[str, torch.Tensor]] = {"int": {}, "tensor": {}}
    for fqn, md in metadata.state_dict_metadata.items():
        parts = fqn.split(".")
        if len(parts) == 3 and parts[0] == "extra" and parts[1] in out:
            out[parts[1]][parts[2]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)  # type: ignore[union-attr]
    return out


def _decode_extras(extras: dict[str, dict[str, torch.Tensor]]) -> dict[str, int | torch.Tensor]:
    out: dict[str, int | torch.Tensor] = {name: int(t.item()) for name, t in extras["int"].items()}
    out.update(extras["tensor"])
    return out


# --- storage -------------------------------------------------------------------------------------


def _is_local(fs: Any) -> bool:
    proto = fs.protocol
    return bool({"file", "local"} & set((proto,) if isinstance(proto, str) else proto))


# --- safetensors files, a JSON marker, an index rebuilt from the headers ----------------------------

DATA_SUFFIX = ".distcp"
"""What DCP names each rank's data file (``__{rank}_{n}.distcp``); in this format each is a safetensors file."""


@functools.cache
def _writer_class() -> type:
    """DCP's fsspec writer in safetensors format, whose coordinator ends with :data:`MARKER` (JSON) instead of
    a pickled ``.metadata``; a class made on first use, as its base is imported then."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    class SafetensorsWriter(FsspecWriter):
        def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
            files = sorted({r.storage_data.relative_path for rank in results for r in rank})
            marker = {"format": STATE_FORMAT, "files": files, "tensors": len(metadata.state_dict_metadata)}
            with self.fs.create_stream(self.fs.concat_path(self.path, MARKER), "wb") as f:
                f.write(json.dumps(marker).encode())

    return SafetensorsWriter


def _writer(url: str, storage_options: Mapping[str, Any] | None) -> Any:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    fs, _ = _fs(url, storage_options)
    # sync_files fsyncs each file, which only a local file has: for any other filesystem DCP falls back
    # to os.sync() of the whole machine, per file, while the object store's upload on close is what
    # makes the data durable there.
    return _writer_class()(url, sync_files=_is_local(fs), serialization_format=SerializationFormat.SAFETENSORS,
                           **fs_options(url, storage_options))


@contextlib.contextmanager
def _local_reader(url: str, storage_options: Mapping[str, Any] | None) -> Iterator[Any]:
    """DCP's safetensors reader over a local copy of the checkpoint's data files (safetensors opens local files
    only): the files the marker lists, each a plain name in the checkpoint's directory."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    fs, path = _fs(url, storage_options)
    try:
        marker = json.loads(fs.cat_file(f"{path.rstrip('/')}/{MARKER}"))
        files = marker["files"] if marker.get("format") == STATE_FORMAT else None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise StateRefused(f"{redact_url(url)}: unreadable {MARKER} ({type(err).__name__})") from None
    if not isinstance(files, list) or not files:
        raise StateRefused(f"{redact_url(url)}: {MARKER} is not a {STATE_FORMAT} marker")
    for name in files:
        # DCP names them; a path elsewhere would read some other file of the store into the model.
        if not isinstance(name, str) or not name.endswith(DATA_SUFFIX) or "/" in name or "\\" in name or name.startswith("."):
            raise StateRefused(f"{redact_url(url)}: a data file outside the checkpoint directory ({name!r})")
    with tempfile.TemporaryDirectory(prefix="ddiloco-state-") as tmp:
        for name in files:
            fs.get_file(f"{path.rstrip('/')}/{name}", os.path.join(tmp, name.removesuffix(DATA_SUFFIX) + ".safetensors"))
        yield HuggingFaceStorageReader(tmp)
