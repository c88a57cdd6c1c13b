"""The quality benchmark's --quick mode runs end to end from a checkout, writes its results where it
says, and leaves the published results alone.

Not a quality test: a few steps of a tiny model say nothing about the gaps between regimes, so
only the shape of the output and the sanity of its numbers are checked here."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from ddiloco.bench.quality import output as O
from ddiloco.bench.quality import plan as P
from ddiloco.bench.quality.run import counting_sql, profile_of
from ddiloco.platform import spans
from ddiloco.platform.config import tokens_per_step

ROOT = Path(__file__).resolve().parent.parent


def published_hashes() -> dict[str, str]:
    """sha256 of every file a --quick run must not touch: the published results, plots and page."""
    paths = [ROOT / O.PUBLISHED_RESULTS, ROOT / O.DOCS_PAGE, *sorted((ROOT / O.PUBLISHED_PLOTS).glob("*.png"))]
    return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One --quick run from the checkout, without --out: its default folder is a new temporary
    directory, here under the test's own (TMPDIR). A few minutes on a loaded 2-core machine: 23
    short in-process runs."""
    tmp = tmp_path_factory.mktemp("quality")
    before = published_hashes()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--quick", "--jobs", "2"],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
        timeout=880,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = re.search(r"^results go to (.+)$", proc.stdout, re.M)
    assert said, proc.stdout[:2000]
    results = Path(said.group(1))
    return json.loads(results.read_text()), proc.stdout, results, tmp, before



@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_writes_where_it_said_and_never_over_the_published_results(quick):
    _, out, results, tmp, before = quick
    assert published_hashes() == before
    assert results.is_relative_to(tmp), results
    assert f"wrote {results}" in out
    for model in P.MODELS:
        png = results.parent / f"quality-{model}.png"
        assert png.stat().st_size > 1000
        assert f"wrote {png}" in out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rows_have_the_issue_shape(quick):
    data = quick[0]
    rows = data["rows"]
    for model in P.MODELS:
        assert {r["regime"] for r in rows if r["model"] == model} >= set(P.REGIMES), model
    for r in rows:
        assert r["model"] in P.MODELS
        assert isinstance(r["tokens"], int) and r["tokens"] > 0
        for key in ("val_loss", "bytes_per_token", "goodput"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["regime"], key)
        assert 0 < r["goodput"] <= 1.0 + 1e-9, (r["model"], r["regime"], r["goodput"])
        if r["model"] == "vision":
            assert 0.0 <= r["val_accuracy"] <= 1.0
        else:
            assert r["val_accuracy"] is None
            # Every text row learned something: below the loss of a uniform guess over its vocabulary.
            vocab = P.LLAMA_VOCAB if r["model"] == "llama" else 256
            assert r["val_loss"] < math.log(vocab), (r["model"], r["regime"], r["val_loss"])
            # nats per byte: per token over the text bytes a token spells (1 for the byte-level models).
            assert r["bytes_per_val_token"] == 1.0 if vocab == 256 else 2.0 < r["bytes_per_val_token"] < 8.0
            assert r["nats_per_byte"] == pytest.approx(r["val_loss"] / r["bytes_per_val_token"])
    assert any(r["regime"].startswith("ablation_") for r in rows)
    assert any(r["regime"].startswith("sweep_") for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_equal_tokens_and_accounting(quick):
    rows = quick[0]["rows"]
    for model in P.MODELS:
        tokens = {r["regime"]: r["tokens"] for r in rows if r["model"] == model}
        # Every regime trains the same tokens (the run stops within one learner step of the target).
        cfgs = [P.build_run_config(s, P.QUICK, True) for s in P.regime_specs(model, P.QUICK)]
        step = max(tokens_per_step(c.model, c.learners.batch_size) for c in cfgs)
        assert max(tokens.values()) - min(tokens.values()) <= step, (model, tokens)
    fail = next(r for r in rows if r["model"] == "dense" and r["regime"] == "decoupled_failures")
    assert 0.1 < fail["lost_fraction"] < 0.4
    assert fail["goodput"] < next(r for r in rows if r["model"] == "dense" and r["regime"] == "decoupled")["goodput"]
    dp = next(r for r in rows if r["model"] == "dense" and r["regime"] == "data_parallel")
    assert dp["bytes_per_token"] > 10 * fail["bytes_per_token"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_report_lines_and_profile(quick):
    data, out, _, _, _ = quick
    assert data["goals"] and all(isinstance(g["pass"], bool) for g in data["goals"])
    assert "PASS" in out or "FAIL" in out
    rows = data["rows"]
    # The data-parallel loop's own spans: one train_step per step.
    dp = next(r for r in rows if r["model"] == "dense" and r["regime"] == "data_parallel")
    assert dp["profile"]["learner.compute.calls"] == dp["knobs"]["steps_per_learner"]
    # The in-process rows: the learner's and synchronizer's spans, and SQL statements, were collected.
    steps = sum(r["profile"].get("learner.compute.calls", 0) for r in rows if r["regime"] != "data_parallel")
    tb = data["time_breakdown"]
    assert tb["learner_steps"] == steps > 0
    assert tb["sql_statements"] > 0 and tb["sync_polls"] > 0
    assert sum(tb["seconds"].values()) == pytest.approx(tb["real_s"], abs=0.1 * len(tb["seconds"]))


def test_profile_keys_are_the_reports():
    totals = {"learner.train_step": 1.23456, "learner.train_step.calls": 3.0, "sql": 0.5, "sql.calls": 7.0,
              "sync.eval": 0.25, "sync.eval.calls": 2.0, "sync.merge": 0.1, "sync.merge.calls": 1.0}
    assert profile_of(totals) == {
        "eval": 0.25, "eval.calls": 2.0, "learner.compute": 1.235, "learner.compute.calls": 3.0,
        "sql.s": 0.5, "sql.statements": 7.0, "sync.merge": 0.1, "sync.merge.calls": 1.0,
    }


def test_sql_statements_are_counted_only_inside_the_block():
    engine = create_engine("sqlite://")
    with spans.collecting() as inside, counting_sql(), engine.connect() as conn:
        conn.execute(text("select 1"))
        conn.execute(text("select 2"))
    with spans.collecting() as after, engine.connect() as conn:
        conn.execute(text("select 3"))
    assert inside["sql.calls"] >= 2 and inside["sql"] >= 0
    assert "sql" not in after


def test_only_the_full_plan_is_published(tmp_path):
    repo = O.checkout(ROOT)
    assert repo == ROOT
    assert O.checkout(tmp_path) is None
    with pytest.raises(ValueError, match="full plan"):
        O.destination(None, publish=True, full_plan=False, repo=repo)
    with pytest.raises(ValueError, match="checkout"):
        O.destination(None, publish=True, full_plan=True, repo=None)
    for published in (ROOT / "benchmarks" / "results", ROOT / "docs"):
        with pytest.raises(ValueError, match="published"):
            O.destination(published, publish=False, full_plan=True, repo=repo)
    dest = O.destination(None, publish=True, full_plan=True, repo=repo)
    assert (dest.results, dest.plots, dest.docs_page) == (ROOT / O.PUBLISHED_RESULTS, ROOT / "docs", ROOT / "docs" / "quality.md")
    mine = O.destination(tmp_path / "q", publish=False, full_plan=True, repo=repo)
    assert (mine.results, mine.plots, mine.docs_page) == (tmp_path / "q" / "quality.json", tmp_path / "q", None)
    assert P.is_published_plan(P.MODELS, quick=False, ablations=True, sweep=True, only=None)
    assert not P.is_published_plan(P.MODELS, quick=True, ablations=True, sweep=True, only=None)
    assert not P.is_published_plan(("dense",), quick=False, ablations=True, sweep=True, only=None)
    assert not P.is_published_plan(P.MODELS, quick=False, ablations=True, sweep=True, only="diloco")


def test_outage_schedule_is_seeded_and_sized():
    ids = [f"dc-{i}" for i in range(4)]
    a = P.outage_schedule(ids, 256.0, 0.25, seed=7)
    assert a == P.outage_schedule(ids, 256.0, 0.25, seed=7)
    assert a != P.outage_schedule(ids, 256.0, 0.25, seed=8)
    down = sum(o.end_s - o.start_s for o in a)
    assert down == pytest.approx(0.25 * 256.0 * 4, rel=1e-3)
    assert not P.all_down_at_some_point(a, len(ids))


# --- the GPU plan (issue #26) at --quick sizes, on the CPU ----------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_quick(tmp_path_factory):
    """``--scale gpu --quick`` from the checkout, into a folder of the test's: the four regimes on a tiny Llama, about a
    minute on 2 cores (most of it listing the installed packages and training the learners)."""
    out = tmp_path_factory.mktemp("quality-gpu")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--scale", "gpu", "--quick", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / O.GPU_RESULTS_NAME).read_text()), proc.stdout, out, cmd


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_gpu_plan_rows_corpus_and_plot(gpu_quick):
    data, stdout, out, _ = gpu_quick
    from ddiloco.bench.provenance import code_digest

    rows = {r["regime"]: r for r in data["rows"]}
    assert list(rows) == list(P.GPU_REGIMES) and data["scale"]["name"] == P.GPU_QUICK.name
    spec = P.gpu_specs(P.GPU_QUICK)[0]
    cfg = P.build_run_config(spec, P.GPU_QUICK, True)
    step = tokens_per_step(cfg.model, cfg.learners.batch_size)
    assert max(r["tokens"] for r in rows.values()) - min(r["tokens"] for r in rows.values()) <= step
    corpus = data["corpus"]
    for r in rows.values():
        assert (r["model"], r["scale"], r["code"], r["device"]) == (P.GPU_MODEL, P.GPU_QUICK.name, code_digest(), "cpu")
        assert r["val_loss"] < math.log(P.GPU_QUICK_VOCAB), r
        assert 1.5 < r["bytes_per_val_token"] < 8.0 and r["nats_per_byte"] == pytest.approx(r["val_loss"] / r["bytes_per_val_token"])
        assert r["bytes_per_token"] > 0 and r["real_s"] > 0 and r["profile"]["learner.compute"] > 0
        assert r["corpus"]["corpus_sha256"] == corpus["corpus_sha256"]
    # Data-parallel sends every gradient in float32 every step, diloco every H = 4 steps, decoupled in int8.
    assert rows["data_parallel"]["bytes_per_token"] > 3 * rows["diloco"]["bytes_per_token"] > 3 * rows["decoupled"]["bytes_per_token"]
    chaos = rows["decoupled_chaos"]
    assert chaos["knobs"]["speeds"] != [1.0] * 8 and 0.1 < chaos["lost_fraction"] < 0.4 and chaos["goodput"] < rows["decoupled"]["goodput"]
    # The manifest: every package with its version and split, none of them the project, whole packages on one side;
    # the shard hashes are those of the files on disk.
    names = [p["name"] for p in corpus["packages"]]
    assert "ddiloco" not in names and len(names) == len(set(names)) and all(p["version"] for p in corpus["packages"])
    assert {p["split"] for p in corpus["packages"]} == {"train", "val"}
    shards = rows["decoupled"]["corpus"]["shards"]
    folder = ROOT / P.gpu_data_dir(True)
    for s in shards:
        assert s["sha256"] == hashlib.sha256((folder / s["path"]).read_bytes()).hexdigest()
    assert sum(s["tokens"] for s in shards) == rows["decoupled"]["corpus"]["train_tokens"] + rows["decoupled"]["corpus"]["val_tokens"]
    assert [g["goal"].split(" /")[0] for g in data["goals"]] == [g for g, _, _ in P.GPU_GOALS]
    assert all(isinstance(g["pass"], bool) for g in data["goals"])
    png = out / f"{O.GPU_PLOT_STEM}-{P.GPU_MODEL}.png"
    assert png.stat().st_size > 1000 and f"wrote {png}" in stdout
    # A GPU row trains for minutes: it says how far it is at every evaluation, as its curve records them.
    for regime, r in rows.items():
        said = re.findall(rf"^   {regime}: +(\d+)% of [\d.]+M tokens, val loss ([\d.]+), \d+ s$", stdout, re.M)
        assert [float(loss) for _, loss in said] == pytest.approx([c[2] for c in r["curve"]], abs=1e-4), regime
        assert said[0][0] == "0" and said[-1][0] == "100", regime


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_gpu_plan_resumes_from_its_results_file(gpu_quick):
    before, _, out, cmd = gpu_quick
    follow_up = next(iter(P.GPU_FOLLOW_UPS))
    proc = subprocess.run([*cmd, "--only", f"decoupled,diloco,{follow_up},data_parallel_seed1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "keeping 4 of this scale, code and corpus" in proc.stdout and "training 2" in proc.stdout
    after = json.loads((out / O.GPU_RESULTS_NAME).read_text())
    assert [r["val_loss"] for r in after["rows"][:4]] == [r["val_loss"] for r in before["rows"]]
    # A row at another seed, named as such, is the same row drawn again: another loss, compared with seed 0's.
    seed1 = after["rows"][-1]
    assert (seed1["regime"], seed1["group"], seed1["base"], seed1["knobs"]["seed"]) == ("data_parallel_seed1", "noise", "data_parallel", 1)
    dp = after["rows"][0]
    assert dp["knobs"]["seed"] == 0 and seed1["tokens"] == dp["tokens"] and seed1["val_loss"] != dp["val_loss"]
    assert f"{P.GPU_MODEL}: data_parallel at seed 1 vs seed 0: {100 * (seed1['val_loss'] / dp['val_loss'] - 1):+.2f}%" in after["notes"]
    # A follow-up row, trained only when named, joins the plan beside its decoupled row; the goals stay the four rows'.
    extra = after["rows"][4]
    base, _, change = P.GPU_FOLLOW_UPS[follow_up]
    change = change["outer"]
    assert (extra["regime"], extra["group"], base) == (follow_up, "sweep", "decoupled") and extra["tokens"] == after["rows"][2]["tokens"]
    assert (extra["knobs"]["outer_lr"], extra["knobs"]["outer_momentum"]) == (change["lr"], change["momentum"])
    assert after["goals"] == before["goals"]
    assert [(a["row"], a["base"]) for a in after["ablations"]] == [(follow_up, "decoupled"), ("data_parallel_seed1", "data_parallel")]


def test_gpu_plan_is_sized_as_the_issue_asks():
    """>= 20M non-embedding parameters, >= 250M tokens a regime, sequences >= 512, 8 learners, bf16 autocast through
    learners.device and torch.compile; every regime the same tokens, seed, batch and schedule."""
    import torch

    from ddiloco.platform.models import build_model

    cfgs = {s.regime: P.build_run_config(s, P.GPU, False, "cuda") for s in P.gpu_specs(P.GPU)}
    assert list(cfgs) == list(P.GPU_REGIMES)
    c = cfgs["decoupled"]
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = build_model(c.model)
    embedding = model.get_input_embeddings().weight.numel()
    assert sum(p.numel() for p in model.parameters()) - embedding >= 20_000_000
    assert c.model.kind == "hf" and c.model.seq_len >= 512 and c.learners.compile and c.learners.device == "cuda"
    assert P.GPU.learners == 8 and P.GPU.learners * P.GPU.steps * tokens_per_step(c.model, c.learners.batch_size) >= 250_000_000
    for cfg in cfgs.values():
        assert (cfg.token_budget, cfg.seed, cfg.learners.batch_size, cfg.inner) == (c.token_budget, c.seed, c.learners.batch_size, c.inner)
        assert cfg.learners.count == 8
    assert (cfgs["decoupled"].fragments.count, cfgs["decoupled"].fragments.period) == (24, 24)
    # A follow-up row changes its row's outer step, period and quorum, nothing else (the chaos row keeps its failures).
    rows = {s.regime: s for s in P.gpu_specs(P.GPU)}
    for spec in P.gpu_follow_up_specs(P.GPU):
        base = rows[spec.base]
        cfg, ref = P.build_run_config(spec, P.GPU, False, "cuda"), cfgs[spec.base]
        assert cfg.model_copy(update={"name": ref.name, "outer": ref.outer, "fragments": ref.fragments, "quorum": ref.quorum}) == ref
        assert (cfg.outer, cfg.fragments.period) != (ref.outer, ref.fragments.period) and cfg.fragments.count == 24
        assert (spec.speeds, spec.failures, spec.group) == (base.speeds, base.failures, "sweep")
    assert {s.base for s in P.gpu_follow_up_specs(P.GPU)} == {"decoupled", "decoupled_chaos"}
    assert cfgs["diloco"].fragments.count == 1 and cfgs["diloco"].quorum.min_count == 8


def test_gpu_rows_at_other_seeds_are_their_rows_drawn_again_and_compare_within_their_seed():
    """ROW_seedN: the same config but the seed (model init, data order, outage schedule); the table and the notes take its
    ratios to the same seed's data-parallel row, never to seed 0's."""
    from dataclasses import replace

    from ddiloco.bench.quality.report import gpu_table, notes
    from ddiloco.bench.quality.run import Row

    every = {s.regime: s for s in P.gpu_specs(P.GPU) + P.gpu_follow_up_specs(P.GPU)}
    seeded = P.gpu_seed_specs(P.GPU)
    assert {s.regime for s in seeded} == {f"{name}_seed{n}" for name in every for n in P.GPU_SEEDS}
    assert [s.regime for s in P.select(seeded, "decoupled_seed2")] == ["decoupled_seed2"]
    for spec in seeded:
        base = every[spec.base]
        cfg, ref = P.build_run_config(spec, P.GPU, False, "cuda"), P.build_run_config(base, P.GPU, False, "cuda")
        assert cfg.seed == spec.seed in P.GPU_SEEDS and cfg.model_copy(update={"name": ref.name, "seed": ref.seed}) == ref
        assert (spec.overrides, spec.speeds, spec.failures, spec.group, spec.knob) == (
            base.overrides, base.speeds, base.failures, "noise", f"seed {spec.seed} (vs 0)")
    ids = [f"dc-{i}" for i in range(P.GPU.learners)]
    assert P.row_outages(ids, P.GPU, P.FAILURE_FRACTION, 1) != P.row_outages(ids, P.GPU, P.FAILURE_FRACTION, 0)

    template = Row(model=P.GPU_MODEL, regime="", group="regime", tokens=1000, val_loss=0.0, val_accuracy=None, bytes_per_token=1.0,
                   goodput=1.0, wall_clock_s=1.0, tokens_merged=1000, bytes_sent=1000, payload_bytes_per_token=1.0, lost_fraction=0.0,
                   merges=1, mean_learners_per_merge=8.0, mean_grace_window_s=0.0, real_s=1.0, knobs={"seed": 0})
    losses = {("data_parallel", 0): 3.0, ("decoupled", 0): 3.06, ("data_parallel", 1): 3.3, ("decoupled", 1): 3.333}
    rows = [replace(template, regime=P.seeded(name, n), val_loss=loss, knobs={"seed": n}, group="noise" if n else "regime",
                    base=name if n else None) for (name, n), loss in losses.items()]
    table = {line.split(" | ")[0].strip("| "): line.split(" | ")[4] for line in gpu_table(rows)[2:]}
    assert table == {"data_parallel": "1.0000", "decoupled": "1.0200", "data_parallel_seed1": "1.0000", "decoupled_seed1": "1.0100"}
    said = notes(rows)
    assert f"{P.GPU_MODEL}: decoupled ÷ data-parallel of the same seed: 1.0200 at seed 0, 1.0100 at seed 1" in said
    assert f"{P.GPU_MODEL}: data_parallel at seed 1 vs seed 0: +10.00%" in said


def test_gpu_plan_publishes_into_its_own_files(tmp_path):
    from ddiloco.bench.quality.report import GPU_BEGIN, GPU_END, with_docs_block

    repo = O.checkout(ROOT)
    dest = O.destination(None, publish=True, full_plan=True, repo=repo, gpu=True)
    assert (dest.results, dest.docs_page, dest.gpu) == (ROOT / O.PUBLISHED_GPU_RESULTS, ROOT / O.DOCS_PAGE, True)
    with pytest.raises(ValueError, match="full plan"):
        O.destination(None, publish=True, full_plan=False, repo=repo, gpu=True)
    assert O.destination(tmp_path, publish=False, full_plan=False, repo=repo, gpu=True).results == tmp_path / O.GPU_RESULTS_NAME
    page = (ROOT / O.DOCS_PAGE).read_text()
    new = with_docs_block(page, f"{GPU_BEGIN}\nnew\n{GPU_END}", GPU_BEGIN, GPU_END)
    assert "\nnew\n" in new and new.split(GPU_BEGIN)[0] == page.split(GPU_BEGIN)[0]
