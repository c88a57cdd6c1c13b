"""``ddiloco chaos-suite --soak`` in CI time: 75 s of faults at 480/hour with a fixed seed whose schedule draws every
kind of the matrix (10 faults, overlapping), on a PostgreSQL server of its own, moto's S3 server and real processes,
run once through the CLI as a user runs it; each test reads its JSON report. The learners are paced to a tenth of
their speed (``--learner-speed``, steps of about a second): at full speed the demo's four learners alone want more than
the 2 cores the whole suite shares (the soak used 243 CPU-seconds in its 128 s alone, 127 paced), and what is under
test is the faults and what the run keeps through them, not the step rate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ddiloco.testing.soak import DRIVER, MATRIX, PG_RESTART

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SEED, DURATION, RATE, SPEED = 18, "75s", 480, 0.1
GOODPUT_FLOOR = 0.4
"""Of the schedule's availability bound. The 15-minute soak at 125/h reached 0.94; here a fault lands every 7.5 s in a
~95 s window, so each relaunch's restart and each takeover's slow first passes weigh ~10x more. Measured: 0.82 (600/h,
load ~5), 0.89 (this seed, load 13 -> 9) and 0.52 (this seed, load 13-16 from other work: shard 0 was killed twice
in 9 s and its new holder's passes crawled, a 64 s gap). A run in which neither shard merged for most of the window
falls below 0.4."""
RSS_BOUND = 1.10


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    tmp = tmp_path_factory.mktemp("soak")
    out = tmp / "soak.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DDILOCO_FAULT"))}
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "chaos-suite", "--soak", DURATION, "--rate", str(RATE), "--seed", str(SEED),
         "--check-every", "20",
         "--learner-speed", str(SPEED), "--json", str(out), "--workdir", str(tmp / "work")],
        capture_output=True, text=True, timeout=540, env=env,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_the_soak_passes_with_no_token_lost_and_the_invariants_held_at_every_check(soak):
    proc, r = soak
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert r["problems"] == []
    assert r["learner_speed"] == SPEED
    checks = r["invariant_checks"]
    assert len(checks) >= 3 and checks[-1]["final"] and checks[-1]["ok"]
    assert all(c["ok"] is not False for c in checks)
    assert r["tokens"]["lost"] == 0
    t = r["tokens"]
    assert t["merged"] > 0
    assert t["trained"] == t["merged"] + t["rejected"] + t["pending"] + t["in_flight"] + t["unsent_at_kill"]


def test_every_fault_of_the_schedule_was_really_applied_on_time(soak):
    _, r = soak
    drawn = {f["kind"] for f in r["timeline"]}
    expected = {k.name for k in MATRIX} - (set(r["skipped_kinds"]) & {PG_RESTART})
    assert drawn == expected
    for f in r["timeline"]:
        assert f["applied"], f
        # Begun at its time (a shard kill first waits for a holder) and ended after its duration.
        assert f["at_s"] - 0.5 <= f["started_s"] <= f["at_s"] + 10, f
        assert f["ended_s"] >= f["started_s"] + f["duration_s"] - 0.5, f
    overlapping = sum(1 for a in r["timeline"] for b in r["timeline"] if a is not b and a["at_s"] < b["at_s"] < a["at_s"] + a["duration_s"])
    assert overlapping >= 2


def test_goodput_stays_near_what_the_schedule_leaves(soak):
    _, r = soak
    assert 0 < r["availability_bound"] < 1
    assert r["goodput_of_bound"] >= GOODPUT_FLOOR, (r["goodput"], r["availability_bound"])
    assert all(g["gap_s"] > 0 for g in r["longest_gap_s"]) and len(r["longest_gap_s"]) == 2


def test_no_process_that_lived_through_the_soak_grew_beyond_the_bound(soak):
    _, r = soak
    run = [g for g in r["growth"] if g["process"] != DRIVER]
    assert len(run) >= 3, [g["process"] for g in r["growth"]]
    for g in run:
        # The peak (VmHWM), not RSS itself: RSS reads ~10% low after a heap trim until a learner's next step, and the
        # suite's slowest learner steps a few times a minute (a working sample of 422 MiB against 464-474 read x1.12).
        assert g["peak_ratio"] <= RSS_BOUND, g
        assert g["end"]["threads"] <= g["start"]["threads"] + 8, g
        assert g["end"]["fds"] <= g["start"]["fds"] + 16, g
    # Ledger connections were counted per process, at the start and at the end.
    assert r["connections"]["start"] and r["connections"]["end"]
    assert sum(r["connections"]["end"].values()) <= 3 * sum(r["connections"]["start"].values())
