"""A learner that lies about its counts or sends outsized updates cannot steer the merge: each claim is
judged against what the run's config makes plausible, rejected with a reason, and the honest learner's
run goes on exactly as without the attacker (real ledger, store and synchronizer, one process)."""

from __future__ import annotations

import math

import pytest
import torch
from support import drive, setup_run, submit_raw, tiny_config

from ddiloco.inprocess import sim_step
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.models import Learner as LearnerRow
from ddiloco.platform.ledger.models import Submission
from ddiloco.platform.models import evaluate
from ddiloco.platform.runtime import to_datetime
from ddiloco.synchronizer import policy as pol
from ddiloco.synchronizer.snapshot import read_snapshot

TPS = 4 * 32  # tiny_config: batch 4 x seq 32 tokens per learner step
H = 4  # tiny_config: 4 fragments, one sent per step


def test_claims_are_judged_against_the_runs_config():
    b, cap = TPS, 8 * H  # tokens one step trains; the steps a learner's updates weigh at most (8 periods)
    assert pol.check_claims(H, H * TPS, TPS, 0, b) is None  # an honest send
    assert pol.check_claims(1, TPS, TPS, 7, b) is None
    assert "empty update" in pol.check_claims(0, TPS, 0, 0, b)
    assert "base version" in pol.check_claims(H, H * TPS, TPS, -1, b)
    assert "new tokens" in pol.check_claims(H, H * TPS, -5, 0, b)
    assert "new tokens" in pol.check_claims(H, H * TPS, 10**15, 0, b)
    assert "tokens in 1 steps" in pol.check_claims(1, 2**40, TPS, 0, b)
    assert "tokens in 3 steps" in pol.check_claims(3, 2**62, TPS, 0, b)
    # Steps are not rejected (slow links fold honest sends together), they weigh at most 8 periods.
    assert pol.check_claims(10**9, 10**9 * TPS, TPS, 0, b) is None
    assert pol.capped_counts(3 * H, 3 * H * TPS, cap) == (3 * H * TPS, 3 * H)
    assert pol.capped_counts(10**9, 10**9 * TPS, cap) == (8 * H * TPS, 8 * H)
    honest = pol.token_weight(*pol.capped_counts(H, H * TPS, cap))
    liar = pol.token_weight(*pol.capped_counts(100 * H, 100 * H * TPS, cap))  # 100 updates at once
    assert liar == 8 * honest  # weighs like 8 periods of honest work, not 100
    assert pol.norm_steps(10**9, cap) == cap and pol.norm_steps(1, cap) == 1  # claiming more buys no room


def test_the_norm_check_holds_from_a_fragments_first_merge():
    plausible = pol.plausible_step_norm(lr=3e-3, weight_decay=0.1, numel=10_000, param_norm=20.0)
    assert plausible == pytest.approx(4 * 3e-3 * 100 + 3e-3 * 0.1 * 20.0)
    # No history yet: the optimizer's bound judges; with one, the recent norms do.
    assert pol.check_norm(0.5 * plausible, [], 10.0, plausible=plausible) is None
    assert "most an inner step" in pol.check_norm(2 * plausible, [], 10.0, plausible=plausible)
    assert pol.check_norm(2 * plausible, [plausible] * 4, 10.0, plausible=plausible) is None


def test_an_outlier_must_stand_out_per_step_and_whole():
    per_step, whole = [0.05] * 4, [1.2] * 4  # 24-step updates of 0.05 a step
    # One step after a blended receipt: 0.62 per step, but smaller whole than an ordinary update.
    assert pol.check_norm(0.62, per_step, 10.0, raw=(0.62, whole)) is None
    assert pol.check_norm(0.62, per_step, 10.0) is not None  # what the per-step rule alone said
    # Large per step and whole: refused, with both figures.
    assert "in all" in pol.check_norm(0.62, per_step, 10.0, raw=(14.9, whole))


def test_no_yardstick_counts_above_what_the_optimizer_can_move():
    """Sends soon after a blended receipt (one step, a period's distance) and a stall's long increment raise a fragment's
    recent maxima above what inner steps can move. Updates outsized together (one learner's 20 increments, each 4x an
    honest one, summed and judged over merge.max_periods periods) stood under bars 10x those maxima, and under a loaded
    machine the quick chaos suite's merged them; the optimizer's bound caps each yardstick."""
    p = pol.plausible_step_norm(lr=3e-3, weight_decay=0.1, numel=17_000, param_norm=20.0)
    max_steps = 32
    inflated_per_step, whole = [0.3 * p, 0.5 * p, 2.0 * p, 2.6 * p], [2.0 * p, 2.2 * p, 3.0 * p, 10.0 * p]
    together = (15.0 * p, 480.0 * p)  # per step over 32 of its 80 claimed steps, and whole
    assert pol.check_norm(together[0], inflated_per_step, 10.0, raw=(together[1], whole)) is None  # what the bare maxima said
    why = pol.check_norm(together[0], inflated_per_step, 10.0, plausible=p, raw=(together[1], whole), plausible_whole=p * max_steps)
    assert why == (f"norm outlier: {together[0]:.4g} per step > 10 x the optimizer's bound {p:.4g}, "
                   f"and {together[1]:.4g} in all > 10 x recent max {10 * p:.4g}")
    # A whole yardstick raised past the most the merge weighs (max_steps at the optimizer's bound) is capped too.
    stalled_whole = [2.0 * p, 2.2 * p, 3.0 * p, 45.0 * p]
    assert pol.check_norm(15.0 * p, [0.5 * p] * 4, 10.0, raw=(400.0 * p, stalled_whole)) is None
    why = pol.check_norm(15.0 * p, [0.5 * p] * 4, 10.0, plausible=p, raw=(400.0 * p, stalled_whole), plausible_whole=p * max_steps)
    assert why.endswith(f"in all > 10 x the optimizer's bound {p * max_steps:.4g}")
    # Honest sends still pass: one step after a blended receipt (large per step, ordinary whole), and a 148-step
    # increment judged over 32 steps.
    assert pol.check_norm(3.0 * p, inflated_per_step, 10.0, plausible=p, raw=(3.0 * p, whole), plausible_whole=p * max_steps) is None
    assert pol.check_norm(0.8 * p, [0.2 * p] * 4, 10.0, plausible=p, raw=(25.6 * p, whole), plausible_whole=p * max_steps) is None


def test_the_synchronizers_judgement_caps_both_yardsticks_and_lets_a_blended_send_through_from_the_first_merge():
    """What the synchronizer calls (``judge_norm``) passes the bound in all, ``max_steps`` steps at the optimizer's bound.

    Before a fragment has a norm history, a send one step after a blended receipt carries part of the outer step
    (several periods long under Nesterov's momentum) on one step: over the per-step bound, within the bound in all. One
    such honest send was rejected (1.282 per step > 1.087) by the link-process test on a loaded machine. After the
    history exists, a whole yardstick a stall inflated no longer lifts the bar above 10 x the bound in all."""
    from ddiloco.synchronizer.validate import Norms, ValidationPolicy, judge_norm

    policy = ValidationPolicy(period=4, outlier_factor=10.0, max_staleness=4, max_periods=8)
    p, none = 1.0, Norms([], [])
    assert policy.max_steps == 32
    assert judge_norm(1.2 * p, 1, none, policy, plausible=p) is None  # one step, a blended receipt's share of the outer step
    assert judge_norm(0.9 * p, 1, none, policy, plausible=p) is None
    assert "most an inner step" in judge_norm(33.0 * p, 1, none, policy, plausible=p)  # over the bound in all too
    assert "most an inner step" in judge_norm(40.0 * p, 2, none, policy, plausible=p)
    stalled = Norms([0.5 * p] * 4, [2.0 * p, 2.2 * p, 3.0 * p, 45.0 * p])
    why = judge_norm(400.0 * p, 40, stalled, policy, plausible=p)  # 12.5 per step over 32 steps; 400 in all
    assert why is not None and why.endswith(f"in all > 10 x the optimizer's bound {32 * p:.4g}"), why
    assert judge_norm(300.0 * p, 40, stalled, policy, plausible=p) is None  # under 10 x the bound in all


def test_an_honest_learner_whose_uploads_stalled_loses_no_work():
    """Sends queued behind a stalled upload fold into one increment of many periods; AdamW moved it further with each
    step, so it must be judged over its steps (up to merge.max_periods periods), not over one period's: once before
    the fragments have a norm history (the optimizer's bound judged a 36-step increment over 4 steps and refused
    it), once after (both bars, per step and whole, over 4 of 148 steps)."""
    from ddiloco.inprocess import sim_step

    for before, stalled in ((0, 40), (30, 150)):
        cfg, clock, ctx, sync, honest = setup_run()
        drive(clock, sync, honest, before)
        for _ in range(stalled):  # the learner trains on, its uploads held back
            clock.t += 1.0
            sim_step(honest, clock.t, pump=False)
            sync.poll_once(clock.t)
        drive(clock, sync, honest, 3 * H)
        with ctx.reading() as s:
            rows = s.query(Submission).filter(Submission.learner_id == "us-0").all()
            acct = reports_q.token_accounting(s, ctx.run_id)
        assert max(r.c_steps for r in rows) > 8 * H, [r.c_steps for r in rows]  # the stall folded many sends together
        assert [(r.c_steps, r.reject_reason) for r in rows if r.status == "rejected"] == [], (before, stalled)
        assert acct.balanced and acct.rejected == 0, acct


def attacked_run():  # noqa: ANN201
    """The shared live run, with the attacker us-1 registered as a learner."""
    cfg, clock, ctx, sync, honest = setup_run()
    with ctx.transaction() as s:
        learner_q.register_learner(s, ctx.run_id, "us-1", "us", to_datetime(clock.t))
    return cfg, clock, ctx, sync, honest


def attack(ctx, clock, fragment: int, tensors: dict, *, c_steps: int, c_tokens: int) -> int:  # noqa: ANN001
    return submit_raw(ctx, clock, fragment, tensors, c_steps=c_steps, c_tokens=c_tokens, tokens_new=TPS)


def val_loss(sync, cfg) -> float:
    from ddiloco.platform.data import build_dataset

    val = build_dataset(cfg.data, cfg.model).val_batches(cfg.learners.batch_size)
    return evaluate(sync.global_model(), val)[0]


def test_a_lying_learner_is_rejected_with_reasons_and_the_honest_run_is_unchanged():
    cfg, clock, ctx, sync, honest = attacked_run()
    shapes = {f: sync.layout.shapes(f) for f in range(cfg.fragments.count)}

    def filled(f: int, value: float) -> dict:
        return {n: torch.full(s, value) for n, s in shapes[f].items()}

    # In the fragments' first merges, before any history: the optimizer's bound is the yardstick.
    lies = {
        attack(ctx, clock, 0, filled(0, 1e-3), c_steps=3, c_tokens=2**62): "implausible claim",  # weight 1e36
        attack(ctx, clock, 1, filled(1, -1e-3), c_steps=1, c_tokens=2**40): "implausible claim",  # the step turned around
        attack(ctx, clock, 2, filled(2, 30.0), c_steps=10**9, c_tokens=10**9 * TPS): "implausible claim",  # years of steps in seconds
        attack(ctx, clock, 2, filled(2, 30.0), c_steps=50_000, c_tokens=50_000 * TPS): "norm outlier",  # huge delta, tiny per step claimed
        attack(ctx, clock, 3, filled(3, 1.0), c_steps=3, c_tokens=3 * TPS): "norm outlier",  # a huge finite delta, plausible counts
    }
    # 100 updates, each of plausible counts, whose sum is outsized: judged as one.
    lies |= {attack(ctx, clock, 1, filled(1, 0.05), c_steps=H, c_tokens=H * TPS): "norm outlier" for _ in range(100)}
    drive(clock, sync, honest, 3 * H)

    # The same honest learner, the same seed, no attacker.
    cfg2, clock2, ctx2, sync2, honest2 = attacked_run()
    drive(clock2, sync2, honest2, 3 * H)

    with ctx.reading() as s:
        for sid, needle in lies.items():
            row = s.get(Submission, sid)
            assert row.status == "rejected" and needle in row.reject_reason, (row.c_steps, row.c_tokens, row.reject_reason)
        honest_rows = s.query(Submission).filter(Submission.learner_id == "us-0").all()
        versions = runs_q.latest_version_numbers(s, ctx.run_id)
        acct = reports_q.token_accounting(s, ctx.run_id)
    assert all(r.status == "merged" for r in honest_rows if r.status != "pending"), "honest work rejected"
    assert all(v >= 2 for v in versions.values()), versions  # every fragment kept publishing
    assert acct.rejected == sum(TPS for _ in lies)  # the attacker's claimed new tokens are counted, as rejected
    a, b = val_loss(sync, cfg), val_loss(sync2, cfg2)
    assert math.isfinite(a) and abs(a / b - 1) < 0.01, (a, b)


def test_counts_no_learner_sends_are_refused_at_registration():
    for bad in ({"c_steps": 0}, {"c_tokens": 0}, {"tokens_new": -1}, {"tokens_new": 10**15}, {"base_version": -1}):
        fields = {"uid": "u", "fragment": 0, "base_version": 0, "c_steps": 4, "c_tokens": 4 * TPS, "tokens_new": TPS,
                  "tokens_total": TPS, "blob_key": "k", "sha256": "0" * 64, "nbytes": 10, "codec": "int8"} | bad
        with pytest.raises(ValueError, match="implausible counts"):
            learner_q.SubmissionIn(**fields)


def test_clipping_scales_an_update_under_the_outlier_bar_to_what_an_honest_one_could_move():
    from ddiloco.synchronizer.merge import FlatDelta, FlatLayout, Member
    from ddiloco.synchronizer.validate import Norms, ValidationPolicy, clip

    policy = ValidationPolicy(period=H, outlier_factor=10.0, max_staleness=4, max_periods=8, clip_factor=2.0)
    layout = FlatLayout.of({"w": (10,)})

    def member(lid: str, value: float, c_steps: int) -> Member:
        row = torch.full((10,), value)
        delta = FlatDelta(layout, row, torch.tensor([float(row.double().pow(2).sum())], dtype=torch.float64))
        return Member(len(lid), lid, delta, delta.norm, c_steps, c_steps * TPS, 0)

    recent = Norms(per_step=[0.1] * 8, whole=[0.1 * H] * 8)
    fair, bold, liar = member("us-0", 0.1 * H / 10**0.5, H), member("us-1", 3 * 0.1 * H / 10**0.5, H), member("eu-1", 1.0, 10 * H)
    members, clipped = clip([fair, bold, liar], recent, policy)
    out = {m.learner: m for m in members}
    assert [c.learner for c in clipped] == ["us-1", "eu-1"]  # each with the norm it had and the bound it was clipped to
    assert out["us-0"].norm == pytest.approx(0.1 * H)  # an honest update is untouched
    assert out["us-1"].norm == pytest.approx(2 * 0.1 * H)  # 3x the median: scaled to 2x
    assert float(out["us-1"].delta.row.norm()) == pytest.approx(2 * 0.1 * H, rel=1e-5)  # the row the merge reads, too
    assert out["eu-1"].norm == pytest.approx(2 * 0.1 * H)  # claiming 10 periods buys no room


def test_tokens_per_step_are_judged_by_the_ranks_a_learner_registered_with():
    cfg, clock, ctx, sync, honest = setup_run()
    limit = cfg.learners.max_world_size
    with ctx.transaction() as s:
        learner_q.register_learner(s, ctx.run_id, "us-1", "us", to_datetime(clock.t), world_size=2, max_world_size=limit)
        learner_q.register_learner(s, ctx.run_id, "us-2", "us", to_datetime(clock.t), max_world_size=limit)  # one rank
        learner_q.register_learner(s, ctx.run_id, "us-3", "us", to_datetime(clock.t), max_world_size=limit)
        # Written around the registration (a learner's role may update its own row): the run's limit still caps it.
        s.get(LearnerRow, (ctx.run_id, "us-3")).world_size = 10 * limit
    # The yardstick: the recorded world, capped by the run's limit; a row from before world sizes were recorded: the limit.
    assert (pol.judged_ranks(2, limit), pol.judged_ranks(10 * limit, limit), pol.judged_ranks(None, limit)) == (2, limit, limit)
    small = {f: {n: torch.full(shape, 1e-6) for n, shape in sync.layout.shapes(f).items()} for f in range(H)}

    def send(fragment: int, learner: str, ranks: int) -> int:
        return submit_raw(ctx, clock, fragment, small[fragment], learner=learner, c_steps=H, c_tokens=H * ranks * TPS, tokens_new=TPS)

    fates = {
        send(0, "us-1", 2): None,  # two ranks' batches a step, from a learner of two ranks
        send(1, "us-2", 2): "implausible claim: 1024 tokens in 4 steps, more than the 128",  # one rank claiming two
        send(2, "us-3", limit): None,
        send(3, "us-3", limit + 1): "implausible claim",  # a row claiming more ranks than the run allows buys no more
    }
    clock.t += 1.0
    sync.poll_once(clock.t)
    with ctx.reading() as s:
        for sid, needle in fates.items():
            row = s.get(Submission, sid)
            if needle is None:
                assert row.status == "merged", (row.learner_id, row.reject_reason)
            else:
                assert row.status == "rejected" and needle in row.reject_reason, (row.learner_id, row.reject_reason)


def test_a_learner_with_more_ranks_than_the_run_allows_is_refused_before_it_trains(tmp_path, monkeypatch):
    import yaml
    from typer.testing import CliRunner

    from ddiloco.cli import app
    from ddiloco.learner_worker.launch import run_learner
    from ddiloco.platform.config import ConfigError

    with pytest.raises(ConfigError, match="nproc_per_node: world size 9 is above learners.max_world_size 8"):
        tiny_config(learners={"nproc_per_node": 9, "max_world_size": 8})
    with pytest.raises(ConfigError, match="max_nproc_per_node is gone: set learners.max_world_size"):
        tiny_config(learners={"max_nproc_per_node": 8})
    cfg = tiny_config(learners={"max_world_size": 8})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    out = CliRunner().invoke(app, ["learner", "--config", str(path), "--learner", "us-0", "--nproc-per-node", "9"])
    assert out.exit_code == 2 and "world size 9 is above learners.max_world_size 8" in out.output, out.output
    # A rank of a torchrun job of 2 nodes x 8 ranks: refused by the world it is in, before it builds a model.
    monkeypatch.setenv("RANK", "3"), monkeypatch.setenv("WORLD_SIZE", "16"), monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(ConfigError, match="world size 16 is above learners.max_world_size 8"):
        run_learner(cfg, "t", "us-0")


def test_one_judgement_of_claims_holds_steps_to_time_and_codecs_to_the_platforms():
    b = TPS
    assert pol.check_claims(H, H * TPS, TPS, 0, b, trained_s=10.0, codec="int8") is None  # an honest send
    assert pol.check_claims(50_000, 50_000 * TPS, TPS, 0, b, trained_s=10.0, codec="none") is None  # a fast learner's fold
    assert "steps in the 10s its learner can have trained" in pol.check_claims(10**9, 10**9 * TPS, TPS, 0, b, trained_s=10.0)
    assert "steps in the 0s" in pol.check_claims(1, TPS, TPS, 0, b, trained_s=-5.0)  # a start claimed in the future
    for codec in ("zstd", "", "INT8", "none\x00", "x" * 10_000):
        assert "implausible claim: codec" in pol.check_claims(H, H * TPS, TPS, 0, b, trained_s=10.0, codec=codec)
    assert all(pol.check_claims(H, H * TPS, TPS, 0, b, codec=c) is None for c in ("none", "bf16", "int8", "int4"))


def test_claims_in_range_of_the_checks_but_not_of_time_dead_learners_and_unknown_codecs_never_reach_the_merge():
    cfg, clock, ctx, sync, honest = attacked_run()
    small = {f: {n: torch.full(shape, 1e-6) for n, shape in sync.layout.shapes(f).items()} for f in range(H)}

    def send(fragment: int, c_steps: int, **kw) -> int:  # noqa: ANN003
        return submit_raw(ctx, clock, fragment, small[fragment], c_steps=c_steps, c_tokens=c_steps * TPS, tokens_new=c_steps * TPS, **kw)

    # Every count within the checks that came before: tokens per step, new tokens, base; a billion steps 1 s in.
    clock.t += 1.0
    inflating = send(0, 10**9)
    codec = send(1, H)
    with ctx.transaction() as s:
        s.get(Submission, codec).codec = "zstd"  # a row written around the learner's functions
    drive(clock, sync, honest, H)
    with ctx.reading() as s:
        assert "implausible claim: 1000000000 steps in the" in s.get(Submission, inflating).reject_reason
        assert "implausible claim: codec 'zstd'" in s.get(Submission, codec).reject_reason
        merged = reports_q.token_accounting(s, ctx.run_id).merged
    assert merged < cfg.token_budget  # a billion steps' tokens would have ended the run (flows stop at the budget)

    # us-1 says nothing for longer than learners.dead_after_s: the ledger counts it dead.
    drive(clock, sync, honest, int(cfg.learners.dead_after_s) + 2)
    dead = send(2, H)
    drive(clock, sync, honest, 1)
    with ctx.reading() as s:
        row = s.get(Submission, dead)
        assert row.status == "rejected" and row.reject_reason.startswith("dead learner 'us-1': no heartbeat for"), row.reject_reason
        assert ("us-1", "dead learner") in {(t.learner_id, t.reason) for t in reports_q.rejected_totals(s, ctx.run_id)}
    # Once it re-registers its work merges again.
    with ctx.transaction() as s:
        incarnation = learner_q.register_learner(s, ctx.run_id, "us-1", "us", to_datetime(clock.t))
    with ctx.reading() as s:
        base = runs_q.latest_version_numbers(s, ctx.run_id)[2]
    back = send(2, H, incarnation=incarnation, base=base)
    drive(clock, sync, honest, 1)
    with ctx.reading() as s:
        assert s.get(Submission, back).status == "merged", s.get(Submission, back).reject_reason
        honest_rows = s.query(Submission).filter(Submission.learner_id == "us-0", Submission.status != "pending").all()
    assert honest_rows and all(r.status == "merged" for r in honest_rows)

    # Work registered while its learner was alive is judged as usual even when the learner is dead by the time the
    # synchronizer reaches it (killed, or cut off by a partition, right after sending): none of it is lost.
    with ctx.reading() as s:
        base = runs_q.latest_version_numbers(s, ctx.run_id)[3]
    before_death = send(3, H, incarnation=incarnation, base=base)
    for _ in range(int(cfg.learners.dead_after_s) + 2):  # us-1 falls silent; only the honest learner goes on
        clock.t += 1.0
        sim_step(honest, clock.t)
    snap, _ = read_snapshot(ctx, clock.t, None, sync.policies, sync.stats)
    assert snap.learners["us-1"].dead is not None and "us-1" not in snap.live
    drive(clock, sync, honest, 2)
    with ctx.reading() as s:
        row = s.get(Submission, before_death)
        assert row.status == "merged", row.reject_reason
