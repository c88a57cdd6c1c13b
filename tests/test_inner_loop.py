"""The inner loop's essentials: LR schedule, parameter groups, gradient accumulation, resumed data position."""

from __future__ import annotations

import math

import pytest
import torch
from support import sim_run, tiny_config

from ddiloco.inprocess import sim_learner, sim_step
from ddiloco.learner_worker.schedule import lr_factor, param_groups, schedule_steps
from ddiloco.platform.config import InnerOptimizerConfig
from ddiloco.platform.data import Batch
from ddiloco.platform.ledger.models import Learner as LearnerRow
from ddiloco.platform.models import build_model


def test_warm_up_then_constant_cosine_or_wsd():
    const = InnerOptimizerConfig(warmup_steps=4)
    assert [lr_factor(s, const, 100) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = InnerOptimizerConfig(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(3, cos, 104) == 1.0
    assert lr_factor(4, cos, 104) == pytest.approx(1.0)
    assert lr_factor(54, cos, 104) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_factor(104, cos, 104) == pytest.approx(0.1) and lr_factor(10_000, cos, 104) == pytest.approx(0.1)
    wsd = InnerOptimizerConfig(warmup_steps=0, schedule="wsd", min_lr_ratio=0.0, decay_fraction=0.25)
    assert lr_factor(0, wsd, 100) == 1.0 and lr_factor(75, wsd, 100) == 1.0
    assert lr_factor(87.5, wsd, 100) == pytest.approx(0.5) and lr_factor(100, wsd, 100) == pytest.approx(0.0)
    assert all(lr_factor(s, wsd, 100) >= lr_factor(s + 1, wsd, 100) for s in range(100))


def test_the_schedule_spans_one_learners_share_of_the_token_budget():
    cfg = tiny_config(token_budget=1_000_000, inner={"grad_accum_steps": 2})
    # 2 learners, batch 4 x 2 micro-batches x seq 32 = 256 tokens a step per rank: 1e6 / (2 * 256 * world) steps each.
    assert schedule_steps(cfg, 1) == 1_000_000 // (2 * 256)
    assert schedule_steps(cfg, 2) == 1_000_000 // (2 * 256 * 2)
    assert schedule_steps(cfg, 8) == 1_000_000 // (2 * 256 * 8)


def test_a_learners_schedule_follows_its_jobs_ranks_not_the_configs_ranks_per_node():
    # learners.nproc_per_node is what a launcher starts per node; this learner is one rank.
    cfg, clock, ctx, sync = sim_run(learners={"nproc_per_node": 8}, token_budget=1_000_000)
    learner = sim_learner(ctx, "us-0")
    assert learner.dist.world == 1
    assert learner.total_steps == schedule_steps(cfg, 1) == 1_000_000 // (2 * 4 * 32)


def test_norms_biases_and_embeddings_are_not_decayed():
    model = build_model(tiny_config().model)
    decay, keep = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    kept = {names[id(p)] for p in keep["params"]}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    assert kept.isdisjoint(decayed) and kept | decayed == set(names.values())
    assert all(p.dim() >= 2 for p in decay["params"]) and not any("embed" in n for n in decayed)
    assert any("embed" in n for n in kept) and any(n.endswith("bias") for n in kept)


def test_the_scheduler_sets_each_steps_learning_rate():
    cfg, clock, ctx, sync = sim_run(inner={"warmup_steps": 3, "schedule": "cosine"}, token_budget=20_000)
    learner = sim_learner(ctx, "us-0")
    learner.start(clock.t)
    total = schedule_steps(cfg, 1)
    for step in range(6):
        assert learner.lr == pytest.approx(cfg.inner.lr * lr_factor(step, cfg.inner, total))
        clock.t += 1.0
        sim_step(learner, clock.t)
    assert learner.lr < cfg.inner.lr  # decaying after warm-up


def test_accumulated_micro_batches_take_the_step_of_their_union():
    # No clipping: a clipped gradient's scale is the clip's, which would hide a sum not divided by the micro-batches.
    inner = {"warmup_steps": 0, "grad_clip": 1e9}
    _, clock, ctx, _ = sim_run(inner={**inner, "grad_accum_steps": 2}, learners={"regions": [{"name": "us", "learners": 1}]})
    _, clock2, ctx2, _ = sim_run(inner=inner, learners={"regions": [{"name": "us", "learners": 1}]})
    accum, whole = sim_learner(ctx, "us-0"), sim_learner(ctx2, "us-0")
    accum.start(clock.t)
    whole.start(clock2.t)
    micro = [next(accum.dataset.train_batches(0, 1, 4, seed=9, start_batch=i)) for i in range(2)]
    union = Batch(torch.cat([b.inputs for b in micro]), torch.cat([b.targets for b in micro]), sum(b.tokens for b in micro))
    accum._batches, whole._batches = iter(micro), iter([union])
    loss_a, tokens_a = accum.train_step()
    loss_w, tokens_w = whole.train_step()
    assert tokens_a == tokens_w and loss_a == pytest.approx(loss_w, rel=1e-6)
    union_params = dict(whole.model.named_parameters())
    for name, p in accum.model.named_parameters():
        # The claim is the gradient: the same up to the order of float sums (a loss not divided by the number of
        # micro-batches would double it, which AdamW's step alone could not show).
        torch.testing.assert_close(p.grad, union_params[name].grad, rtol=1e-5, atol=1e-7)
        # AdamW's first step is g / (|g| + eps): where |g| is near eps that rounding moves it by up to a step, so the
        # parameters are held to 1% of a step, not to float rounding (an AVX-512 Xeon put one weight 0.13% apart).
        torch.testing.assert_close(p, union_params[name], rtol=1e-5, atol=0.01 * accum.lr)
    assert accum.batches_drawn == 2 and whole.batches_drawn == 1


def test_a_new_incarnation_goes_on_where_its_last_registered_submission_left_off():
    cfg, clock, ctx, sync = sim_run(inner={"grad_accum_steps": 2})
    first = sim_learner(ctx, "us-0")
    first.start(clock.t)
    for _ in range(7):
        clock.t += 1.0
        sim_step(first, clock.t)
        sync.poll_once(clock.t)
    clock.t += 1.0
    first.step(clock.t)  # trained, its send queued but never uploaded: the learner "dies" here
    with ctx.reading() as s:
        position = s.get(LearnerRow, (ctx.run_id, "us-0")).data_batches
    assert position == 7 * 2 and first.batches_drawn == 8 * 2
    second = sim_learner(ctx, "us-0")
    second.start(clock.t)
    assert second.incarnation == 1 and second.batches_drawn == position
    assert second.schedule_offset == 7 and second.lr == pytest.approx(cfg.inner.lr * lr_factor(7, cfg.inner, second.total_steps))
    # Its next batch is the one after the last registered submission's, not the stream's start.
    expected = next(second.dataset.train_batches(0, 2, cfg.learners.batch_size, seed=cfg.seed * 1_000_003, start_batch=position))
    assert torch.equal(next(second._batches).inputs, expected.inputs)
    fresh = next(second.dataset.train_batches(0, 2, cfg.learners.batch_size, seed=cfg.seed * 1_000_003))
    assert not torch.equal(expected.inputs, fresh.inputs)


def test_a_loss_read_one_step_late_trains_the_same_and_reports_each_loss_one_step_later():
    """A GPU learner reads a step's loss one step late (``LateRead``); the same code made late on the CPU trains the
    very same parameters and reports the prompt learner's losses, moving average and tokens one step later."""
    from ddiloco.learner_worker.device import LateRead

    seen = {}
    for late in (False, True):
        _, clock, ctx, sync = sim_run(learners={"regions": [{"name": "us", "learners": 1}]}, inner={"grad_accum_steps": 2})
        learner = sim_learner(ctx, "us-0")
        learner.loss_read = LateRead(late)
        learner.start(clock.t)
        losses, averages, tokens = [], [], []
        for _ in range(6):
            clock.t += 1.0
            report = sim_step(learner, clock.t)
            losses.append(report.loss)
            averages.append(learner.last_loss)
            tokens.append(report.tokens)
            sync.poll_once(clock.t)
        seen[late] = losses, averages, tokens, [p.detach().clone() for p in learner.model.parameters()]
    (losses, averages, tokens, params), (late_losses, late_averages, late_tokens, late_params) = seen[False], seen[True]
    assert all(isinstance(x, float) and math.isfinite(x) for x in losses) and len(set(losses)) > 1
    assert late_losses == [None, *losses[:-1]] and late_averages == [None, *averages[:-1]]
    assert late_tokens == tokens and all(t > 0 for t in tokens)
    assert all(torch.equal(a, b) for a, b in zip(params, late_params))


def test_compiled_learner_trains_as_the_eager_one_does():
    """learners.compile: the learner's forward and loss run through torch.compile (dynamo compiles frames for it), and
    its steps follow the eager learner's to float tolerance (inductor reorders float32 sums)."""
    from torch._dynamo.utils import counters

    runs = {}
    for compile_ in (False, True):
        _, clock, ctx, sync = sim_run(learners={"compile": compile_, "regions": [{"name": "us", "learners": 1}]})
        learner = sim_learner(ctx, "us-0")
        learner.start(clock.t)
        frames = counters["stats"]["unique_graphs"]
        losses = []
        for _ in range(3):
            clock.t += 1.0
            losses.append(sim_step(learner, clock.t).loss)
        runs[compile_] = (losses, counters["stats"]["unique_graphs"] - frames)
    (eager, eager_graphs), (compiled, compiled_graphs) = runs[False], runs[True]
    assert eager_graphs == 0 and compiled_graphs > 0
    assert all(math.isfinite(x) for x in compiled)
    assert compiled == pytest.approx(eager, rel=1e-4)


def _train_with_merges(learner, clock, sync, steps: int) -> tuple[list, list[float], int]:
    """``steps`` simulated seconds of a started learner, the synchronizer polling after each: its losses, its learning
    rates and the fragments it received."""
    losses, lrs, received = [], [], 0
    for _ in range(steps):
        clock.t += 1.0
        report = sim_step(learner, clock.t)
        losses.append(report.loss)
        received += len(report.received)
        lrs.append(learner.lr)
        sync.poll_once(clock.t)
    return losses, lrs, received


def test_decoding_on_the_device_changes_nothing_a_cpu_learner_computes():
    """learners.decode_on_device on a CPU learner: its downloads go through an I/O that decodes on the learner's device
    (the CPU) and holds the compact bases there, and it trains exactly as without the option."""
    from ddiloco.learner_worker.learner import Learner
    from ddiloco.learner_worker.link import LearnerLink

    runs = {}
    for decode_on_device in (False, True):
        _, clock, ctx, sync = sim_run(learners={"decode_on_device": decode_on_device, "regions": [{"name": "us", "learners": 1}]},
                                      compression={"codec": "int8"})
        learner = Learner(ctx.cfg, "us-0", index=0, num_learners=1, link=LearnerLink(ctx, "us-0", "us"), clock=ctx.now)
        learner.start(clock.t)
        losses, _, received = _train_with_merges(learner, clock, sync, 2 * ctx.cfg.fragments.count)
        io = learner.link.downloader.io
        assert io.device == learner.device and io.bases and received > 0
        runs[decode_on_device] = (losses, [p.detach().clone() for p in learner.model.parameters()])
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1], strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False here)")
@pytest.mark.parametrize(("compiled", "parallelism", "decode_on_device", "recompute"),
                         [(False, "ddp", False, "none"), (True, "ddp", False, "none"), (False, "fsdp", False, "none"),
                          (False, "ddp", True, "none"), (False, "fsdp", False, "full")],
                         ids=["eager", "compiled", "fsdp", "decode-on-device", "fsdp-recompute"])
def test_the_inner_loop_trains_on_a_gpu_and_its_fragments_merge(compiled, parallelism, decode_on_device, recompute):

    _, clock, ctx, sync = sim_run(
        learners={"device": "cuda", "compile": compiled, "parallelism": parallelism, "decode_on_device": decode_on_device,
                  "activation_checkpoint": recompute, "regions": [{"name": "us", "learners": 1}]},
        inner={"grad_accum_steps": 2, "schedule": "cosine", "warmup_steps": 1},
        # Compact downloads (an int8 run's), so that a learner decoding on its device holds their bases there.
        compression={"codec": "int8" if decode_on_device else "none"},
    )
    try:
        _train_on_the_gpu(ctx, clock, sync)
    finally:
        # A one-rank FSDP learner made a private process group: it must not outlive the test.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _train_on_the_gpu(ctx, clock, sync) -> None:
    from ddiloco.learner_worker.learner import Learner
    from ddiloco.learner_worker.link import LearnerLink
    from ddiloco.platform.ledger import runs as runs_q

    # Built as a learner process builds it (no process group): on the device the config names.
    learner = Learner(ctx.cfg, "us-0", index=0, num_learners=1, link=LearnerLink(ctx, "us-0", "us"), clock=ctx.now)
    assert learner.device.type == "cuda" and all(p.is_cuda for p in learner.model.parameters())
    assert learner.encode_stream is not None and all(s.is_cuda for f in learner.fragments for s in f.snapshot)
    # With activation checkpointing, its blocks recompute under bf16 autocast in the backward pass.
    assert learner.checkpointed_blocks == (ctx.cfg.model.n_layer if ctx.cfg.learners.activation_checkpoint == "full" else 0)
    learner.start(clock.t)
    losses, lrs, received = _train_with_merges(learner, clock, sync, 2 * ctx.cfg.fragments.count)
    # A GPU learner reads each step's loss one step late (the host never waits for the step it just queued).
    assert learner.loss_read.late and losses[0] is None and all(math.isfinite(x) for x in losses[1:])
    assert lrs[-1] < lrs[1]  # the cosine decays after its warm-up step
    with ctx.transaction() as s:
        versions = runs_q.latest_version_numbers(s, ctx.run_id)
    assert max(versions.values()) >= 1, versions  # the GPU learner's outer gradients were merged
    assert received >= 1  # and the merged versions came back onto the GPU
    io = learner.link.downloader.io
    if ctx.cfg.learners.decode_on_device:
        # Decoded there: the bases of its compact downloads live on the GPU, and nothing is pinned in host memory.
        assert io.device.type == "cuda" and not learner.link.downloader.pin
        assert io.bases and all(t.is_cuda for b in io.bases.values() for t in b.tensors.values())
    else:
        assert io.device.type == "cpu" and learner.link.downloader.pin
