"""Registering a run and reading its global state: shared by learners, synchronizer and tools."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddiloco.platform.fragments import Fragment, partition_module
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.models import FragmentVersion
from ddiloco.platform.models import build_model
from ddiloco.platform.runtime import RunContext, code_version
from ddiloco.platform.store import FragmentStore


@dataclass(frozen=True)
class Layout:
    """The model of a run and how its parameters are split into fragments."""

    model: torch.nn.Module
    fragments: list[Fragment]

    def shapes(self, fragment: int) -> dict[str, tuple[int, ...]]:
        """The fragment's tensor shapes by piece key (a row piece has its own row count)."""
        return {pc.key: pc.shape for pc in self.fragments[fragment].pieces}


def build_layout(ctx: RunContext) -> Layout:
    model = build_model(ctx.cfg.model, seed=ctx.cfg.seed)
    return Layout(model=model, fragments=partition_module(model, ctx.cfg.fragments.count))


def register_run(ctx: RunContext, layout: Layout, flow_run_url: str | None = None) -> bool:
    """Record the run, its effective config, code version and fragment layout (idempotent)."""
    version, commit = code_version()
    with ctx.transaction() as s:
        created = runs_q.create_run(
            s,
            ctx.run_id,
            config_json=ctx.cfg.to_json(),
            code_version=version,
            git_commit=commit,
            num_fragments=len(layout.fragments),
            token_budget=ctx.cfg.token_budget,
            now=ctx.now_dt(),
            flow_run_url=flow_run_url,
        )
        runs_q.set_fragment_specs(
            s,
            ctx.run_id,
            [
                (f.index, [[key, list(shape)] for key, shape in layout.shapes(f.index).items()], f.numel, f.nbytes)
                for f in layout.fragments
            ],
        )
    return created


def read_version(store: FragmentStore, row: FragmentVersion) -> dict[str, torch.Tensor]:
    """The tensors of one published fragment version by piece key, verified against the ledger's sha256
    (``fragments.assemble`` makes whole parameters of several fragments' pieces)."""
    return store.get(row.blob_key, row.sha256)
