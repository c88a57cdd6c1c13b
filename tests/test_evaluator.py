"""Evaluation off the merge path: the synchronizer's pass never evaluates; the evaluator records
evaluations of published versions on its own cadence, in its own OS process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from support import tiny_config

from ddiloco.inprocess import SimClock, in_memory_config, sim_learner, sim_step
from ddiloco.platform import spans
from ddiloco.platform.ledger import open_ledger
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.runtime import RunContext, to_datetime, to_timestamp
from ddiloco.platform.tracking import TensorBoardTracker
from ddiloco.synchronizer.evaluation import evaluate_global, newest_params
from ddiloco.synchronizer.evaluator import Evaluator
from ddiloco.synchronizer.series import TENSORBOARD_ENV, EvalSeries, series_for
from ddiloco.synchronizer.service import Synchronizer

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = dict(
    learners={"regions": [{"name": "us", "learners": 1}], "heartbeat_s": 1.0},
    quorum={"min_count": 1},
    grace={"enabled": False},
    synchronizer={"eval_every_s": 2.0},
)


def scalars(logdir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """The TensorBoard scalars under ``logdir``: tag -> [(step, value, wall time)], as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_the_synchronizer_pass_never_evaluates_and_the_evaluator_records_published_versions(tmp_path: Path) -> None:
    cfg = in_memory_config(tiny_config(name="evaluator", **SECTIONS))
    clock = SimClock()
    ctx = RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(cfg.ledger.url), clock=clock)
    sync = Synchronizer(ctx, holder="sync")  # the config's cadence, which used to make it evaluate
    learner = sim_learner(ctx, "us-0")
    with spans.collecting() as totals:
        sync.poll_once(clock.t)
        learner.start(clock.t)
        for _ in range(3 * cfg.fragments.count):  # several times eval_every_s, with merges
            clock.t += 1.0
            sim_step(learner, clock.t)
            sync.poll_once(clock.t)
    evaluator = Evaluator(ctx, series=EvalSeries(TensorBoardTracker(str(tmp_path / "tb"))))
    with ctx.reading() as s:
        assert runs_q.evaluations(s, ctx.run_id) == []
        published = runs_q.latest_version_numbers(s, ctx.run_id)
    assert totals.get("sync.eval.calls", 0) == 0 and totals["sync.merge.calls"] > 0
    assert sum(published.values()) > 0

    loss, _ = evaluator.evaluate_once(clock.t)
    assert evaluator.evaluate_once(clock.t + 5) is None  # nothing published since: nothing to evaluate
    for _ in range(cfg.fragments.count):
        clock.t += 1.0
        sim_step(learner, clock.t)
        sync.poll_once(clock.t)
    later, _ = evaluator.evaluate_once(clock.t)
    with ctx.reading() as s:
        evals = runs_q.evaluations(s, ctx.run_id)
        now_published = runs_q.latest_version_numbers(s, ctx.run_id)
    assert [e.val_loss for e in evals] == [loss, later]
    assert [e.versions_total for e in evals] == [sum(published.values()), sum(now_published.values())]
    assert evals[1].versions_total > evals[0].versions_total and evals[1].tokens > evals[0].tokens
    # What it recorded is the newest published model's loss.
    assert later == pytest.approx(evaluate_global(cfg, newest_params(ctx))[0], rel=1e-6)
    # And the same series went to TensorBoard, against the tokens merged, at the evaluations' times.
    series = scalars(tmp_path / "tb")
    assert [(step, pytest.approx(value)) for step, value, _ in series["eval/val_loss"]] == [(e.tokens, e.val_loss) for e in evals]
    assert [(step, value) for step, value, _ in series["eval/versions_total"]] == [(e.tokens, e.versions_total) for e in evals]
    assert [at for _, _, at in series["eval/val_loss"]] == pytest.approx([to_timestamp(e.at) for e in evals])
    assert "eval/val_accuracy" not in series and all(e.val_accuracy is None for e in evals)  # a language model has none


def test_with_shards_the_evaluator_waits_for_version_0_of_every_fragment(caplog) -> None:
    """Each shard's holder publishes version 0 of its own fragments: until both have, there is no whole model to
    evaluate, which is a wait (said once), not an error."""
    cfg = in_memory_config(tiny_config(name="evalshards", **{**SECTIONS, "synchronizer": {**SECTIONS["synchronizer"], "shards": 2}}))
    clock = SimClock()
    ctx = RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(cfg.ledger.url), clock=clock)
    assert Synchronizer(ctx, holder="sync-a").poll_once(clock.t).role == "active"  # half the fragments at version 0
    evaluator = Evaluator(ctx)
    with caplog.at_level("INFO", logger="ddiloco.evaluator"):
        assert 0 < len(evaluator.published()) < cfg.fragments.count
        assert evaluator.evaluate_once(clock.t + 1) is None and evaluator.evaluate_once(clock.t + 2) is None
    assert [r.getMessage() for r in caplog.records if r.name == "ddiloco.evaluator"] == [
        f"waiting for version 0 of every fragment ({len(evaluator.published())} published so far)"]
    assert Synchronizer(ctx, holder="sync-b").poll_once(clock.t).role == "active"  # the other shard's holder
    assert len(evaluator.published()) == cfg.fragments.count
    loss, _ = evaluator.evaluate_once(clock.t + 3)
    assert loss == pytest.approx(evaluate_global(cfg, newest_params(ctx))[0], rel=1e-6)


def test_the_evaluator_refuses_a_cadence_that_is_not_positive_and_a_device_that_is_no_device() -> None:
    cfg = in_memory_config(tiny_config(name="cadence0"))
    ctx = RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(cfg.ledger.url), clock=SimClock())
    with pytest.raises(ValueError, match="cadence must be > 0"):
        Evaluator(ctx, every_s=0)
    for bad in ("gpu", "meta", "cuda:x"):
        with pytest.raises(ValueError, match=f"must be auto, cpu, cuda or cuda:N, got '{bad}'"):
            Evaluator(ctx, device=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_the_evaluator_on_a_gpu_records_the_cpu_loss() -> None:
    cfg = in_memory_config(tiny_config(name="evalgpu", **SECTIONS))
    ctx = RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(cfg.ledger.url), clock=SimClock())
    Synchronizer(ctx, holder="sync").poll_once(0.0)  # version 0 (merged on the GPU: auto)
    gpu = Evaluator(ctx, device="auto")
    assert next(gpu.model.parameters()).device.type == "cuda"
    loss, _ = gpu.evaluate_once(1.0)
    assert loss == pytest.approx(evaluate_global(cfg, newest_params(ctx))[0], rel=1e-4)


def test_ddiloco_evaluate_is_its_own_process_and_stops_when_the_run_has_ended(tmp_path: Path) -> None:
    cfg = tiny_config(name="evalproc", ledger={"url": f"sqlite:///{tmp_path / 'ledger.db'}"},
                      storage={"url": f"file://{tmp_path / 'store'}"}, **SECTIONS)
    ctx = RunContext.open(cfg, cfg.name)
    Synchronizer(ctx, holder="sync").poll_once()  # registers the run and publishes version 0
    with ctx.transaction() as s:
        runs_q.set_run_status(s, ctx.run_id, "finished", to_datetime(ctx.now()))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = subprocess.run([sys.executable, "-m", "ddiloco", "evaluate", "--config", str(config), "--run", cfg.name],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, TENSORBOARD_ENV: str(tmp_path / "tb")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    with ctx.reading() as s:
        evals = runs_q.evaluations(s, ctx.run_id)
    assert len(evals) == 1 and evals[0].versions_total == 0  # version 0 of every fragment, evaluated once
    # DDILOCO_TENSORBOARD_DIR: the process wrote that evaluation to TensorBoard under the run's name, as its evaluator.
    assert [(step, pytest.approx(value)) for step, value, _ in scalars(tmp_path / "tb" / cfg.name / "evaluator")["eval/val_loss"]] == [
        (evals[0].tokens, evals[0].val_loss)]


def test_the_evaluation_series_follow_the_tracker_variables(tmp_path: Path) -> None:
    cfg = tiny_config()
    assert series_for(cfg, "r", {}) is None and series_for(cfg, "r", {TENSORBOARD_ENV: ""}) is None
    series = series_for(cfg, "r", {TENSORBOARD_ENV: str(tmp_path / "tb")})
    series.add(tokens=4096, versions_total=3, val_loss=1.5, val_accuracy=0.25, at=1.7e9)
    series.close()
    assert scalars(tmp_path / "tb" / "r" / "evaluator") == {
        "eval/val_loss": [(4096, 1.5, 1.7e9)], "eval/val_accuracy": [(4096, 0.25, 1.7e9)], "eval/versions_total": [(4096, 3.0, 1.7e9)]}


@pytest.mark.slow
def test_the_evaluator_waits_out_a_ledger_restart(tmp_path: Path, caplog) -> None:
    """A PostgreSQL restart under the evaluator: it keeps ticking and goes on once the server is back (it used to die
    on the run-status read, outside its retry; the 30-minute soak found it gone)."""
    import logging
    import threading

    from ddiloco.testing.net import wait_for
    from ddiloco.testing.postgres import ThrowawayCluster

    try:
        pg = ThrowawayCluster.start()
    except RuntimeError as err:
        pytest.skip(f"no PostgreSQL cluster of its own to restart: {err}")
    try:
        cfg = tiny_config(name="evalpg", ledger={"url": pg.url}, storage={"url": f"file://{tmp_path / 'store'}"}, **SECTIONS)
        ctx = RunContext.open(cfg, cfg.name)
        Synchronizer(ctx, holder="sync").poll_once()  # registers the run and publishes version 0
        evaluator = Evaluator(ctx, every_s=0.1)
        stop, failures = threading.Event(), []

        def run() -> None:
            try:
                evaluator.run(stop)
            except BaseException as err:  # noqa: BLE001 - the test's verdict
                failures.append(err)

        thread = threading.Thread(target=run, daemon=True)
        with caplog.at_level(logging.ERROR, logger="ddiloco"):
            thread.start()
            wait_for(lambda: evaluator.evaluated, 60, "the first evaluation")
            pg.halt()
            try:
                wait_for(lambda: "reading the run's status failed" in caplog.text or not thread.is_alive(), 30,
                         "a failed status read while the server is down")
                assert thread.is_alive() and not failures, failures
            finally:
                pg.resume()
            ctx.engine.dispose()  # sessions of the halted server are gone
            ticks = caplog.text.count("reading the run's status failed")
            caplog.clear()
            with ctx.reading() as s:  # the server is back
                assert runs_q.get_run(s, cfg.name) is not None
            stop.set()
            thread.join(30)
        assert not thread.is_alive() and not failures, failures
        assert ticks >= 1
    finally:
        pg.stop()
