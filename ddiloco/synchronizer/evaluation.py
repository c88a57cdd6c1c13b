"""Evaluating the global model: plain functions of the published fragments, apart from any synchronizer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ddiloco.platform.config import RunConfig
from ddiloco.platform.data import build_dataset
from ddiloco.platform.fragments import assemble
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.models import build_model, evaluate
from ddiloco.platform.run_state import read_version
from ddiloco.platform.runtime import RunContext, to_datetime
from ddiloco.platform.spans import span
from ddiloco.synchronizer.merge import GlobalFragment

if TYPE_CHECKING:
    from ddiloco.synchronizer.series import EvalSeries


def newest_params(ctx: RunContext, cache: Mapping[int, GlobalFragment] | None = None) -> dict[str, torch.Tensor]:
    """Every fragment's newest published parameters as whole tensors by parameter name (row pieces
    reassembled), taken from ``cache`` where it holds that version."""
    with ctx.reading() as s:
        latest = runs_q.latest_versions(s, ctx.run_id)
    cache = cache or {}
    store = ctx.store()
    pieces: dict[str, torch.Tensor] = {}
    for fragment, row in latest.items():
        cached = cache.get(fragment)
        pieces.update(cached.params if cached is not None and cached.version == row.version else read_version(store, row))
    return assemble(pieces)


def load_params(model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """Copy whole tensors ``params`` into the model's parameters of the same names (in place); returns the model.

    Every name must be a parameter of the model, with its exact shape (``copy_`` would broadcast a
    short tensor silently)."""
    own = dict(model.named_parameters())
    for n, t in params.items():
        if n not in own:
            raise ValueError(f"tensor {n!r} is not a parameter of the model")
        if tuple(t.shape) != tuple(own[n].shape):
            raise ValueError(f"tensor {n!r} has shape {tuple(t.shape)}, the model's parameter {tuple(own[n].shape)}")
    with torch.no_grad():
        for n, t in params.items():
            own[n].copy_(t)
    return model


def evaluate_global(
    cfg: RunConfig, params: Mapping[str, torch.Tensor], *, model: torch.nn.Module | None = None
) -> tuple[float, float | None]:
    """(validation loss, accuracy or None) of the run's model holding ``params``.

    ``model`` (overwritten) saves building one; by default a fresh model of ``cfg.model``. The
    evaluation runs where ``model`` lives (a GPU model gets its batches moved there)."""
    model = load_params(build_model(cfg.model, seed=cfg.seed) if model is None else model, params)
    batches = build_dataset(cfg.data, cfg.model).val_batches(cfg.learners.batch_size)
    device = next(model.parameters()).device
    if device.type != "cpu":
        batches = [replace(b, inputs=b.inputs.to(device), targets=b.targets.to(device)) for b in batches]
    return evaluate(model, batches)


def evaluate_and_record(
    ctx: RunContext,
    now: float,
    *,
    cache: Mapping[int, GlobalFragment] | None = None,
    model: torch.nn.Module | None = None,
    series: EvalSeries | None = None,
) -> tuple[float, float | None]:
    """Evaluate the newest global model and record the result (with the merged tokens) in the ledger,
    and in ``series`` once recorded."""
    with span("sync.eval"):
        loss, acc = evaluate_global(ctx.cfg, newest_params(ctx, cache), model=model)
        with ctx.transaction() as s:
            acct = reports_q.token_accounting(s, ctx.run_id)
            versions = sum(runs_q.latest_version_numbers(s, ctx.run_id).values())
            runs_q.record_evaluation(
                s, ctx.run_id, now=to_datetime(now), tokens=acct.merged, versions_total=versions, val_loss=loss, val_accuracy=acc
            )
    if series is not None:
        series.add(tokens=acct.merged, versions_total=versions, val_loss=loss, val_accuracy=acc, at=now)
    return loss, acc
