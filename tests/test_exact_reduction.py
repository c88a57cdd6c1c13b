"""With K = M, P = 1, plain mean, no compression and overlap 0, Decoupled DiLoCo is synchronous DiLoCo.

The reference below is written from the DiLoCo paper, independently of the platform's code:
M replicas, H AdamW steps each (weight decay on matrices only, as the platform's inner optimizer
does: not on norms, biases or embeddings), outer gradient = global - local, averaged, Nesterov SGD."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from support import tiny_config

from ddiloco.inprocess import run_inprocess
from ddiloco.platform.data import build_dataset
from ddiloco.platform.models import build_model, compute_loss

M, H, ROUNDS = 3, 4, 3


def reference_diloco(cfg, device: str = "cpu") -> dict[str, torch.Tensor]:
    """On a GPU with bf16 autocast around the loss, as a GPU learner computes it; the outer step in float32 either way."""
    global_model = build_model(cfg.model, seed=cfg.seed).to(device)
    replicas = [build_model(cfg.model, seed=cfg.seed).to(device) for _ in range(M)]
    for r in replicas:
        r.load_state_dict(global_model.state_dict())
    def groups(model: torch.nn.Module) -> list[dict]:
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        matrices = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings]
        rest = [p for p in model.parameters() if p.dim() < 2 or id(p) in embeddings]
        return [{"params": matrices, "weight_decay": cfg.inner.weight_decay}, {"params": rest, "weight_decay": 0.0}]

    inner = [torch.optim.AdamW(groups(r), lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2)) for r in replicas]
    outer = torch.optim.SGD(global_model.parameters(), lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=True)
    data = build_dataset(cfg.data, cfg.model)
    streams = [data.train_batches(i, M, cfg.learners.batch_size, seed=cfg.seed * 1_000_003) for i in range(M)]
    step = 0
    for _ in range(ROUNDS):
        for m in range(M):
            for h in range(H):
                s = step + h
                lr = cfg.inner.lr * min(1.0, (s + 1) / cfg.inner.warmup_steps)
                for g in inner[m].param_groups:
                    g["lr"] = lr
                batch = next(streams[m])
                batch = replace(batch, inputs=batch.inputs.to(device), targets=batch.targets.to(device))
                with torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext():
                    loss, _ = compute_loss(replicas[m], batch)
                inner[m].zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(replicas[m].parameters(), cfg.inner.grad_clip)
                inner[m].step()
        step += H
        with torch.no_grad():
            for name, gp in global_model.named_parameters():
                locals_ = [dict(r.named_parameters())[name] for r in replicas]
                gp.grad = torch.stack([gp - lp for lp in locals_]).mean(0)
        outer.step()
        outer.zero_grad()
        with torch.no_grad():
            for r in replicas:
                r.load_state_dict(global_model.state_dict())
    return {n: p.detach().cpu().clone() for n, p in global_model.named_parameters()}


def sync_config():
    return tiny_config(
        learners={"regions": [{"name": "us", "learners": M}]},
        fragments={"count": 1, "every": H, "overlap": 0},
        quorum={"min_count": M},
        grace={"enabled": False},
        merge={"method": "mean", "weighting": "equal", "max_staleness": 0, "on_receipt": "overwrite"},
        outer={"lr": 0.7, "momentum": 0.9},
        compression={"codec": "none"},
    )


def test_decoupled_reduces_exactly_to_synchronous_diloco():
    cfg = sync_config()
    tokens = M * H * ROUNDS * cfg.learners.batch_size * cfg.model.seq_len
    run = run_inprocess(cfg, total_tokens=tokens)
    expected = reference_diloco(cfg)
    got = {n: p.detach() for n, p in run.sync.global_model().named_parameters()}
    with run.ctx.transaction() as s:
        from ddiloco.platform.ledger import runs as runs_q

        assert runs_q.latest_version_numbers(s, run.ctx.run_id) == {0: ROUNDS}
    moved = max(float((expected[n] - build_model(cfg.model, seed=cfg.seed).state_dict()[n]).abs().max()) for n in expected)
    assert moved > 1e-3, "the reference did not train: the comparison would be vacuous"
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=2e-5, msg=f"parameter {name} differs")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False here)")
def test_on_a_gpu_the_platform_trains_synchronous_diloco_as_written():
    """The GPU path (bf16 autocast, increments encoded on a side stream, receipts through pinned memory, the in-process
    hand-off) gives the reference's global model. bf16 and atomics make the two differ a little: the difference is held
    to a small share of how far the parameters moved, which a lost or stale fragment would exceed many times."""
    cfg = sync_config()
    tokens = M * H * ROUNDS * cfg.learners.batch_size * cfg.model.seq_len
    run = run_inprocess(cfg, total_tokens=tokens, device=torch.device("cuda"))
    expected = reference_diloco(cfg, "cuda")
    got = {n: p.detach().cpu() for n, p in run.sync.global_model().named_parameters()}
    init = build_model(cfg.model, seed=cfg.seed).state_dict()
    moved = torch.cat([(expected[n] - init[n]).flatten() for n in expected]).norm()
    off = torch.cat([(got[n] - expected[n]).flatten() for n in expected]).norm()
    assert float(moved) > 1e-2, "the reference did not train: the comparison would be vacuous"
    assert float(off) <= 0.02 * float(moved), (float(off), float(moved))


def test_reduction_breaks_when_a_merge_rule_changes():
    """The comparison is sensitive: RDA instead of the plain mean moves parameters far beyond the tolerance."""
    cfg = tiny_config(
        learners={"regions": [{"name": "us", "learners": M}]},
        fragments={"count": 1, "every": H, "overlap": 0},
        quorum={"min_count": M},
        grace={"enabled": False},
        merge={"method": "rda", "weighting": "equal", "plain_mean_fragments": []},
        compression={"codec": "none"},
    )
    tokens = M * H * ROUNDS * cfg.learners.batch_size * cfg.model.seq_len
    run = run_inprocess(cfg, total_tokens=tokens)
    expected = reference_diloco(cfg)
    got = dict(run.sync.global_model().named_parameters())
    diff = max(float((got[n].detach() - expected[n]).abs().max()) for n in expected)
    assert diff > 1e-3, diff
