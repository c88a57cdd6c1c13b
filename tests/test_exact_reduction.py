"""With K = M, P = 1, plain mean, no compression and overlap 0, Decoupled DiLoCo is synchronous DiLoCo.

The reference below is written from the DiLoCo paper, independently of the platform's code:
M replicas, H AdamW steps each (weight decay on matrices only, as the platform's inner optimizer
does: not on norms, biases or embeddings), outer gradient = global - local, averaged, Nesterov SGD."""

from __future__ import annotations

import torch
from support import tiny_config

from ddiloco.inprocess import run_inprocess
from ddiloco.platform.data import build_dataset
from ddiloco.platform.models import build_model, compute_loss

M, H, ROUNDS = 3, 4, 3


def reference_diloco(cfg) -> dict[str, torch.Tensor]:
    global_model = build_model(cfg.model, seed=cfg.seed)
    replicas = [build_model(cfg.model, seed=cfg.seed) for _ in range(M)]
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
                loss, _ = compute_loss(replicas[m], next(streams[m]))
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
    return {n: p.detach().clone() for n, p in global_model.named_parameters()}


def test_decoupled_reduces_exactly_to_synchronous_diloco():
    cfg = tiny_config(
        learners={"regions": [{"name": "us", "learners": M}]},
        fragments={"count": 1, "every": H, "overlap": 0},
        quorum={"min_count": M},
        grace={"enabled": False},
        merge={"method": "mean", "weighting": "equal", "max_staleness": 0, "on_receipt": "overwrite"},
        outer={"lr": 0.7, "momentum": 0.9},
        compression={"codec": "none"},
    )
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
