"""The quality benchmark's --quick mode runs end to end and writes the JSON the docs are built from.

Not a quality test: a few steps of a tiny model say nothing about the gaps between regimes, so
only the shape of the output and the sanity of its numbers are checked here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.bench import quality as Q

# A few minutes on a loaded 2-core machine: 23 short in-process runs.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quality")
    out = tmp / "quality.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=880,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, tmp


def test_rows_have_the_issue_shape(quick):
    data, _, _ = quick
    rows = data["rows"]
    for model in Q.MODELS:
        assert {r["regime"] for r in rows if r["model"] == model} >= set(Q.REGIMES), model
    for r in rows:
        assert r["model"] in Q.MODELS
        assert isinstance(r["tokens"], int) and r["tokens"] > 0
        for key in ("val_loss", "bytes_per_token", "goodput"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["regime"], key)
        assert 0 < r["goodput"] <= 1.0 + 1e-9, (r["model"], r["regime"], r["goodput"])
        if r["model"] == "vision":
            assert 0.0 <= r["val_accuracy"] <= 1.0
        else:
            assert r["val_accuracy"] is None
            # Every text row learned something: below the loss of a uniform guess over 256 bytes.
            assert r["val_loss"] < math.log(256), (r["model"], r["regime"], r["val_loss"])
    assert any(r["regime"].startswith("ablation_") for r in rows)
    assert any(r["regime"].startswith("sweep_") for r in rows)


def test_equal_tokens_and_accounting(quick):
    data, _, _ = quick
    rows = data["rows"]
    for model in Q.MODELS:
        tokens = {r["regime"]: r["tokens"] for r in rows if r["model"] == model}
        # Every regime trains the same tokens (the run stops within one learner step of the target).
        step = max(Q._tokens_per_step(Q.build_run_config(s, Q.QUICK, True)) for s in Q.regime_specs(model, Q.QUICK))
        assert max(tokens.values()) - min(tokens.values()) <= step, (model, tokens)
    fail = next(r for r in rows if r["model"] == "dense" and r["regime"] == "decoupled_failures")
    assert 0.1 < fail["lost_fraction"] < 0.4
    assert fail["goodput"] < next(r for r in rows if r["model"] == "dense" and r["regime"] == "decoupled")["goodput"]
    dp = next(r for r in rows if r["model"] == "dense" and r["regime"] == "data_parallel")
    assert dp["bytes_per_token"] > 10 * fail["bytes_per_token"]


def test_report_lines_and_plots(quick):
    data, out, tmp = quick
    assert data["goals"] and all(isinstance(g["pass"], bool) for g in data["goals"])
    assert "PASS" in out or "FAIL" in out
    assert data["time_breakdown"]["learner_steps"] > 0
    for model in Q.MODELS:
        assert (tmp / f"quality-{model}.png").stat().st_size > 1000


def test_outage_schedule_is_seeded_and_sized():
    ids = [f"dc-{i}" for i in range(4)]
    a = Q.outage_schedule(ids, 256.0, 0.25, seed=7)
    assert a == Q.outage_schedule(ids, 256.0, 0.25, seed=7)
    assert a != Q.outage_schedule(ids, 256.0, 0.25, seed=8)
    down = sum(o.end_s - o.start_s for o in a)
    assert down == pytest.approx(0.25 * 256.0 * 4, rel=1e-3)
    assert not Q._all_down_at_some_point(a, len(ids))
