"""``ddiloco export``: the global model of a run as safetensors or a Hugging Face ``save_pretrained`` directory.

Read-only against the ledger and store. The model is built from the config the run recorded in the
ledger, filled with the chosen global fragment versions through the synchronizer's own
``load_params``, and written from the model, so exports never depend on how fragments name their
tensors. ``--version N`` takes, for every fragment, its newest version that is at most N (fragment
versions are dense, so that is ``min(N, newest)``); ``latest`` takes every fragment's newest."""

from __future__ import annotations

import json
import posixpath
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import fsspec
import torch
from safetensors.torch import save_file

from ddiloco.platform.config import ConfigError, RunConfig, build_config
from ddiloco.platform.fragments import assemble
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.models import build_model
from ddiloco.platform.models.hf import is_hf
from ddiloco.platform.models.weights import WEIGHTS_FILE
from ddiloco.platform.run_state import read_version
from ddiloco.platform.runtime import RunContext
from ddiloco.platform.tokenize import TOKENIZER_FILES
from ddiloco.synchronizer.evaluation import load_params, newest_params

Format = Literal["hf", "safetensors"]
RUN_FILE = "ddiloco-run.json"
"""Written beside the weights: the run, the fragment versions exported, and the run's model config."""


class ExportError(ValueError):
    """An export that cannot be made; the message names the problem."""


@dataclass(frozen=True)
class Export:
    to: str
    versions: dict[int, int]
    """Fragment -> the global version exported."""
    files: list[str]


def recorded_config(ctx: RunContext) -> RunConfig:
    """The config the run recorded in the ledger (its model, seed and data are the run's truth)."""
    with ctx.reading() as s:
        run = runs_q.require_run(s, ctx.run_id)
        config_json = run.config_json
    try:
        return build_config(json.loads(config_json))
    except ConfigError as err:
        raise ExportError(f"run {ctx.run_id}: its recorded config no longer validates: {err}") from None


def global_params(ctx: RunContext, version: int | None = None) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """The fragments' tensors at ``version`` (None: every fragment's newest) and the version taken for each."""
    with ctx.reading() as s:
        latest = runs_q.latest_versions(s, ctx.run_id)
        if not latest:
            raise ExportError(f"run {ctx.run_id} has no published global version yet")
        if version is None:
            rows = latest
        else:
            rows = {f: runs_q.get_version(s, ctx.run_id, f, min(version, row.version)) for f, row in latest.items()}
    if version is None:
        return newest_params(ctx), {f: row.version for f, row in rows.items()}
    pieces: dict[str, torch.Tensor] = {}
    store = ctx.store()
    for f, row in rows.items():
        if row is None or row.blob_deleted:
            v = min(version, latest[f].version)
            raise ExportError(
                f"fragment {f} version {v} is gone from the store (retention keeps the newest synchronizer.retention.keep_last "
                "and every checkpoint_every-th version): pick another --version"
            )
        pieces.update(read_version(store, row))
    return assemble(pieces), {f: row.version for f, row in rows.items()}


def _tokenizer_files(cfg: RunConfig) -> list[tuple[str, str]]:
    """(source URL, file name) of the run's tokenizer files, when data.tokenizer names a file or directory."""
    tokenizer = getattr(cfg.data, "tokenizer", None)
    if not tokenizer:
        return []
    fs, path = fsspec.core.url_to_fs(str(tokenizer))
    if not fs.exists(path):
        raise ExportError(f"data.tokenizer {tokenizer!r} does not exist: the export would lack its tokenizer")
    if not fs.isdir(path):
        return [(fs.unstrip_protocol(path), posixpath.basename(path))]
    return [
        (fs.unstrip_protocol(p), posixpath.basename(p))
        for p in sorted(fs.ls(path, detail=False))
        if posixpath.basename(p) in TOKENIZER_FILES and fs.isfile(p)
    ]


def _write_local(model: torch.nn.Module, cfg: RunConfig, fmt: Format, out: Path, meta: dict) -> None:
    if fmt == "hf":
        model.save_pretrained(out)
        for src, name in _tokenizer_files(cfg):
            with fsspec.open(src, "rb") as f_in, open(out / name, "wb") as f_out:
                shutil.copyfileobj(f_in, f_out)
    else:
        tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
        save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
    (out / RUN_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))


def export_run(ctx: RunContext, *, to: str, fmt: Format = "safetensors", version: int | None = None) -> Export:
    """Write the run's global model at ``version`` (None: the newest) to ``to``, a local directory or fsspec URL that must not
    exist yet or be empty."""
    cfg = recorded_config(ctx)
    model = build_model(cfg.model, seed=cfg.seed)
    if fmt == "hf" and not is_hf(model):
        raise ExportError(f"--format hf needs model.kind 'hf' (run {ctx.run_id} is {cfg.model.kind!r}): use --format safetensors")
    fs, root = fsspec.core.url_to_fs(to)
    if fs.exists(root) and (not fs.isdir(root) or fs.ls(root, detail=False)):
        raise ExportError(f"{to} already exists and is not an empty directory: an export never overwrites")
    params, versions = global_params(ctx, version)
    load_params(model, params)
    meta = {"run": ctx.run_id, "versions": {str(f): v for f, v in sorted(versions.items())}, "seed": cfg.seed,
            "model": cfg.model.model_dump(mode="json")}
    with tempfile.TemporaryDirectory(prefix="ddiloco-export-") as tmp:
        _write_local(model, cfg, fmt, Path(tmp), meta)
        files = sorted(p.name for p in Path(tmp).iterdir())
        fs.makedirs(root, exist_ok=True)
        for name in files:
            fs.put_file(str(Path(tmp) / name), posixpath.join(root, name))
    return Export(to=to, versions=versions, files=files)
