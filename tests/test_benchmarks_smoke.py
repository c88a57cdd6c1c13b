"""Each benchmark's --quick mode runs, and writes JSON with the expected keys and sane values.

They run in parallel (one fixture starts them all), so the module takes about as long as the
slowest, the failover run with its four processes.

Not a performance test: figures on a small shared machine vary, so only their shape and sanity
are checked here, never PASS/FAIL against a goal."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


NAMES = ("learner_overhead", "merge_throughput", "failover", "sync_sustain", "largest_model", "upload_linger")


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """Start every benchmark's --quick run at once (they take ~20-40 s each on a loaded 2-core
    machine; in parallel the module stays near a minute), then collect their outputs."""
    tmp = tmp_path_factory.mktemp("bench")
    procs = {}
    for name in NAMES:
        out = tmp / f"{name}.json"
        log = open(tmp / f"{name}.log", "w+")  # noqa: SIM115 - closed after the run
        procs[name] = (
            subprocess.Popen(
                [sys.executable, str(BENCH / f"{name}.py"), "--quick", "--json", str(out)],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            ),
            out,
            log,
        )
    results = {}
    try:
        for name, (proc, out, log) in procs.items():
            try:
                rc = proc.wait(timeout=240)
            except subprocess.TimeoutExpired:
                proc.terminate()  # SIGTERM: the benchmark stops the processes it started
                proc.wait(timeout=30)
                rc = "timeout"
            log.seek(0)
            results[name] = (rc, out, log.read())
    finally:
        for proc, _, log in procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()
    return results


def load(quick_runs, name: str, goal: bool = True) -> dict:
    rc, out, text = quick_runs[name]
    assert rc == 0, f"{name} --quick failed ({rc}):\n{text[-4000:]}"
    data = json.loads(out.read_text())
    for key in ("benchmark", "date", "commit", "machine"):
        assert key in data, f"{name}: missing {key!r}"
    assert data["benchmark"] == name
    assert data["machine"]["cores"] >= 1
    if goal:
        assert "PASS" in text or "FAIL" in text, text
        assert isinstance(data["goal"]["pass"], bool)
    return data


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_learner_overhead_quick(quick_runs):
    d = load(quick_runs, "learner_overhead")
    assert len(d["pairs"]) >= 2
    for p in d["pairs"]:
        assert positive(p["bare_tokens_per_s"]) and positive(p["platform_tokens_per_s"])
        assert 0.2 < p["ratio"] < 5
    assert 0.2 < d["ratio_median_of_pairs"] < 5 and 0.2 < d["ratio_pooled"] < 5
    share = d["main_thread_share"]
    assert set(share) == {"train_step", "send", "apply_received", "save_state", "other_in_step"}
    assert 0.2 < share["train_step"] <= 1.0
    assert abs(sum(share.values()) - 1.0) < 1e-3
    assert d["fragments_sent"] > 0  # the platform really traded fragments
    assert d["synchronizer_merge_device"] == "cpu"
    assert d["goal"]["ratio_min"] == 0.95
    # Model FLOP/s of each loop: its tokens/s times the model's FLOPs per token; a CPU has no peak, so no MFU.
    assert positive(d["model_flops_per_token"])
    assert d["model_flops_per_s"]["bare"] == pytest.approx(d["bare_tokens_per_s"] * d["model_flops_per_token"], rel=1e-3)
    assert d["mfu"] == {"bare": None, "platform": None}
    io_off = d["link_io_off"]
    assert io_off["pairs"] == 1 and 0.2 < io_off["ratio_median_of_pairs"] < 5 and positive(io_off["train_step_slowdown_vs_bare"])


def test_upload_linger_quick(quick_runs):
    """Both variants really upload: the benchmark wraps the upload thread's handler, and a wrapper that no longer fits
    its call (as once, when the handler gained an argument) killed the thread and timed a learner that sent nothing."""
    d = load(quick_runs, "upload_linger", goal=False)
    assert d["linger_s"]["none"] == 0 and d["linger_s"]["linger"] > 0
    for kind in ("none", "linger"):
        w = d["rounds"][0][kind]
        assert w["sent"] > 0 and w["sends_per_exchange"] >= 1 and positive(w["link_cpu_ms_per_send"]), (kind, w)
        assert 0.05 < w["ratio"] < 5, (kind, w)


def test_merge_throughput_quick(quick_runs):
    d = load(quick_runs, "merge_throughput")
    assert set(d["codecs"]) == {"int8", "int4", "bf16"}
    for codec, e in d["codecs"].items():
        assert e["float32_bytes"] == d["fragment"]["submissions"] * d["fragment"]["params"] * 4
        assert 0 < e["wire_bytes"] < e["float32_bytes"]
        for key in ("pipeline_gb_s_float32", "pipeline_gb_s_wire", "memcpy_gb_s", "ratio_vs_memcpy"):
            assert positive(e[key]), (codec, key, e[key])
        assert e["ratio_vs_memcpy"] < 5
        assert abs(sum(e["stage_share"].values()) - 1.0) < 0.01
        assert e["max_rel_diff_vs_reference"] < 1e-4  # the flat rows compute the same merge as dict-shaped deltas
    assert d["goal"]["ratio_min"] == 0.25


def test_failover_quick(quick_runs):
    d = load(quick_runs, "failover")
    assert d["config"]["lease_ttl_s"] == 3.0
    assert len(d["kills"]) == 1
    k = d["kills"][0]
    assert k["new_holder"] and k["new_holder"] != k["killed"]
    assert k["new_token"] > k["killed_token"]
    assert positive(k["failover_s"]) and k["failover_s"] < 60
    # The standby learns of the death from the killed holder's presence lock: it takes over before the lease runs out.
    assert k["takeover_by"] == "presence" and k["takeover_s"] < k["lease_left_s"]
    assert k["tokens_per_s_before"]["reported"] > 0 and k["tokens_per_s_after"]["reported"] > 0
    sm = d["summary"]
    assert sm["failover_max_s"] == sm["failover_p99_s"] == max(sm["failover_s"])  # nearest rank: of one kill, that kill
    assert positive(sm["tokens_per_s_baseline"]) and positive(sm["tokens_per_s_after_vs_baseline"])
    assert list(d["ledgers"]) == ["sqlite"] and d["ledgers"]["sqlite"]["kills"] == d["kills"]


def test_sync_sustain_quick(quick_runs):
    d = load(quick_runs, "sync_sustain")
    (p,) = d["points"]
    assert (p["shards"], p["learners"], p["store"]) == (1, 2, "file")
    # The simulated learners submitted on schedule and the real synchronizer merged their submissions.
    assert p["submissions"] > 0 and p["merges"] > 0 and p["driver"]["failed"] == 0
    assert p["driver"]["lag_s_median"] is not None and p["driver"]["lag_s_median"] < 1.0
    assert p["staleness_median"] is not None and 0 <= p["staleness_median"] <= 4
    assert p["rejected_share"] == 0.0
    assert p["backlog"]["samples"] >= 2 and p["backlog"]["bound"] == 10
    (sync,) = p["synchronizers"]
    assert sync is not None and positive(sync["pass"]) and positive(sync["publish"])
    assert isinstance(p["keeps_up"], bool) and isinstance(p["conclusive"], bool)
    assert d["goal"]["one_shard_min"] == 16 and d["goal"]["scaling_min"] == 1.7


def test_largest_model_quick(quick_runs):
    d = load(quick_runs, "largest_model")
    assert set(d["runs"]) == {"ddp", "fsdp", "fsdp+ac", "fsdp+sac"}
    for par, run in d["runs"].items():
        sizes = [r["params"] for r in run["tried"]]
        assert len(sizes) == 3 and sizes == sorted(sizes), par
        assert all(r["status"] == "trained" and positive(r["tokens_per_s"]) for r in run["tried"]), par
        assert run["largest_trained"]["params"] == sizes[-1] and run["stopped_by"] == "sizes exhausted"
        # The same size costs the same model FLOPs whether its activations are recomputed or not; a CPU has no MFU.
        assert all(positive(r["model_flops_per_token"]) and r["mfu"] is None for r in run["tried"]), par
        assert all(r["planned_state_gb"] == round(20 * r["params"] / 2**30, 2) for r in run["tried"]), par
        # The learner's outer snapshot is held too (4 bytes a parameter at world 1), and a fragment sent every step.
        assert all(r["snapshot_bytes"] == 4 * r["params"] and r["fragments"] >= 2 and r["sends"] == d["args"]["steps"] + 1
                   for r in run["tried"]), par
    for mode in ("fsdp+ac", "fsdp+sac"):
        assert [r["model_flops_per_token"] for r in d["runs"]["fsdp"]["tried"]] == [
            r["model_flops_per_token"] for r in d["runs"][mode]["tried"]]
    # No OOM on a CPU: both train the largest tiny size, and tokens/s is compared there.
    c = d["comparison"]
    assert c["largest_params_fsdp_vs_ddp"] == 1.0 and positive(c["tokens_per_s_fsdp_vs_ddp"])
    assert c["tokens_per_s_compared_at_params"] == d["runs"]["ddp"]["largest_trained"]["params"]
    # Recomputing the activations is compared with the same run's plain fsdp, at the largest size both trained.
    r = d["activation_checkpoint"]
    assert set(r) == {"fsdp+ac", "fsdp+sac"}
    for mode in r.values():
        assert mode["largest_params_vs_plain"] == 1.0 and positive(mode["tokens_per_s_vs_plain"])
        assert mode["tokens_per_s_compared_at_params"] == d["runs"]["fsdp"]["largest_trained"]["params"]


def test_learner_overhead_names_its_results_by_device_model_and_parallelism():
    sys.path.insert(0, str(BENCH))
    import learner_overhead as lo

    assert lo.result_name("cpu", None, None) == "learner_overhead"  # the published names stay
    assert lo.result_name("cuda", "demo", None) == "learner_overhead_cuda"
    assert lo.result_name("cuda", "llama100m", "ddp") == "learner_overhead_cuda_llama100m_ddp"
    assert lo.result_name("cpu", None, None, 1, 32) == "learner_overhead_b1s32"
    assert lo.result_name("cpu", None, None, 1, 32, link_process=True) == "learner_overhead_b1s32_linkproc"
    assert lo.result_name("cuda", "llama100m", "ddp", sync_device="auto") == "learner_overhead_cuda_llama100m_ddp_syncauto"
    assert lo.result_name("cuda", "llama100m", "ddp", decode_on_device=True) == "learner_overhead_cuda_llama100m_ddp_devdecode"
    assert lo.bench_config("x", decode_on_device=True).learners.decode_on_device and not lo.bench_config("x").learners.decode_on_device
    # The benchmark's synchronizer merges off the learner's GPU unless asked to share it.
    assert lo.bench_config("x").synchronizer.merge_device == "cpu"
    assert lo.bench_config("x", sync_device="auto").synchronizer.merge_device == "auto"
    assert lo.bench_config("x", link_process=True).learners.link_process and not lo.bench_config("x").learners.link_process
    cfg = lo.bench_config("x", model="llama100m", parallelism="fsdp")
    assert (cfg.model.kind, cfg.model.seq_len, cfg.learners.batch_size, cfg.learners.parallelism) == ("hf", 1024, 8, "fsdp")
    assert lo.bench_config("x", quick=True, model="llama100m", parallelism="ddp").learners.parallelism == "ddp"
    small = lo.bench_config("x", batch_size=1, seq_len=32)
    assert (small.learners.batch_size, small.model.seq_len, small.model.d_model) == (1, 32, lo.bench_config("x").model.d_model)


def test_a_quick_run_never_writes_over_the_published_results(tmp_path, monkeypatch):
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(common, "QUICK_RESULTS", tmp_path / "results" / "quick")
    assert common.write_results("b", {"args": {"quick": True}, "x": 1}) == tmp_path / "results" / "quick" / "b.json"
    assert not (tmp_path / "results" / "b.json").exists()
    assert common.write_results("b", {"args": {"quick": False}, "x": 2}) == tmp_path / "results" / "b.json"
    assert common.write_results("b", {"args": {"quick": True}}, str(tmp_path / "own.json")) == tmp_path / "own.json"
    assert json.loads((tmp_path / "results" / "b.json").read_text())["x"] == 2
    # No path of the measuring machine reaches a committed result.
    tmp = tempfile.gettempdir()
    common.write_results("c", {"args": {}, "ledger": f"sqlite:///{tmp}/ui-bench/ledger.db", "runs": [{"log": f"{ROOT}/x.log"}]})
    written = (tmp_path / "results" / "c.json").read_text()
    assert json.loads(written)["ledger"] == "sqlite:///<tmp>/ui-bench/ledger.db"
    assert json.loads(written)["runs"] == [{"log": "<repo>/x.log"}] and str(ROOT) not in written
    assert "benchmarks/results/quick/" in (ROOT / ".gitignore").read_text().splitlines()


def test_a_benchmarks_own_results_do_not_make_the_next_one_dirty(tmp_path):
    """A GPU suite's first step writes benchmarks/results/: the next step measured the same code, not a dirty tree."""
    from ddiloco.bench.provenance import git_state

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    for d in ("ddiloco", "benchmarks/results", "docs"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "f").write_text("a")
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    assert git_state(tmp_path)["dirty"] is False
    (tmp_path / "benchmarks/results/f").write_text("b")
    (tmp_path / "docs/f").write_text("b")
    state = git_state(tmp_path)
    assert state["dirty"] is False and len(state["commit"]) == 40
    (tmp_path / "ddiloco/f").write_text("b")
    assert git_state(tmp_path)["dirty"] is True


def test_gpu_setup_puts_the_carried_postgresql_on_path(tmp_path):
    """A GPU image without PostgreSQL: setup unpacks the carried pgserver wheel's binaries (modes kept, libraries
    beside them) and puts its initdb first on PATH; without the wheel it says what is missing and fails."""
    import stat
    import zipfile

    wheels = tmp_path / "whl"
    wheels.mkdir()
    # A stand-in for the wheel's layout, no download: a shell initdb that says its version, and a library folder.
    with zipfile.ZipFile(wheels / "pgserver-0.1.4-cp312-cp312-manylinux2014_x86_64.whl", "w") as z:
        exe = zipfile.ZipInfo("pgserver/pginstall/bin/initdb")
        exe.external_attr = (stat.S_IFREG | 0o755) << 16
        z.writestr(exe, "#!/bin/sh\necho 'initdb (PostgreSQL) 99.1'\n")
        z.writestr("pgserver.libs/libpq-x.so.5", b"\0")
        z.writestr("pgserver/__init__.py", "")  # not unpacked: only the binaries, libraries and share/ are
    dest = tmp_path / "pg"
    path = ":".join(p for p in os.environ["PATH"].split(":") if p and not (Path(p) / "initdb").exists())
    script = f"source {BENCH / 'gpu_env.sh'}; setup_postgres && command -v initdb"
    env = {**os.environ, "ROOT": str(ROOT), "PATH": path, "GPU_SUITE_SYSTEM_PG": str(tmp_path / "none"),
           "GPU_SUITE_PG": str(dest), "GPU_SUITE_WHEELS": str(wheels)}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "postgresql: initdb (PostgreSQL) 99.1 from pgserver-0.1.4" in out.stdout
    initdb = dest / "pgserver/pginstall/bin/initdb"
    assert out.stdout.strip().splitlines()[-1] == str(initdb) and os.access(initdb, os.X_OK)
    assert (dest / "pgserver.libs/libpq-x.so.5").exists() and not (dest / "pgserver/__init__.py").exists()

    (wheels / "pgserver-0.1.4-cp312-cp312-manylinux2014_x86_64.whl").unlink()
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no pgserver wheel in" in out.stdout


def test_gpu_suite_plan_fits_ten_minutes():
    out = subprocess.run(["bash", str(BENCH / "gpu_suite.sh"), "--plan"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if re.search(r"cap\s+\d+ s", line)]
    caps = [int(re.search(r"cap\s+(\d+) s", line).group(1)) for line in lines if "(extra:" not in line]
    total = int(re.search(r"sum of caps\s+(\d+) s", out.stdout).group(1))
    assert len(caps) == 10 and sum(caps) == total <= 600
    # An extra step is in the plan but not in the default suite's budget; named in --only, it counts.
    extra = [line for line in lines if "(extra:" in line]
    assert [line.split()[0] for line in extra] == ["overhead_demo_syncgpu", "upload_linger", "overhead_llama_syncgpu",
                                                   "overhead_llama_devdecode", "largest_model_ac"]
    both = subprocess.run(["bash", str(BENCH / "gpu_suite.sh"), "--plan", "--only", "overhead_llama_ddp,overhead_llama_syncgpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert both.returncode == 0 and re.search(r"of the steps asked\s+180 s", both.stdout), both.stdout + both.stderr


def test_gpu_suite_runs_only_the_steps_asked_for(tmp_path):
    """--only: a short device lease runs part of the suite; the record says which steps were not asked for."""
    suite = ["bash", str(BENCH / "gpu_suite.sh")]
    plan = subprocess.run([*suite, "--plan", "--only", "overhead_demo,merge_cuda"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert re.search(r"of the steps asked\s+115 s", plan.stdout) and plan.stdout.count("(not in --only)") == 7
    bad = subprocess.run([*suite, "--plan", "--only", "overhead_demo,bogus"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no step 'bogus'" in bad.stderr
    env = {**os.environ, "GPU_SUITE_OUT": str(tmp_path / "out"), "GPU_SUITE_LOGS": str(tmp_path / "logs")}
    run = subprocess.run([*suite, "--dry-run", "--only", "merge_cuda"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "gpu_suite.json").read_text())
    status = {step["step"]: step["status"] for step in record["steps"]}
    assert status.pop("setup") == "passed" and status.pop("merge_cuda") == "passed"
    assert len(status) == 8 and set(status.values()) == {"not run (not in --only)"}
    assert (tmp_path / "out" / "merge_throughput_cuda.json").exists()


def test_quality_gpu_script_refuses_what_it_cannot_run():
    """The GPU quality plan's script (its --dry-run is the --quick plan that test_quality_smoke.py runs): a bad option, and
    a machine without a GPU unless --dry-run, are told at once."""
    bad = subprocess.run(["bash", str(BENCH / "quality_gpu.sh"), "--bogus"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    if shutil.which("nvidia-smi", path=env["PATH"]):
        pytest.skip("this machine has nvidia-smi: the script would start the GPU plan")
    nogpu = subprocess.run(["bash", str(BENCH / "quality_gpu.sh"), "decoupled"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=60)
    assert nogpu.returncode == 2 and "--dry-run" in nogpu.stderr


def test_the_gpu_plans_diloco_row_is_textbook_diloco(tmp_path):
    """diloco_reference.py --quick: the GPU plan's diloco row (tiny, on the CPU) ends where the same DiLoCo written in
    plain torch does, and the quality script runs it with --reference."""
    out = tmp_path / "ref.json"
    run = subprocess.run(["bash", str(BENCH / "quality_gpu.sh"), "--dry-run", "--reference", "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(out.read_text())
    rows = got["rows"]
    assert set(rows) == {"platform", "reference", "single"}
    start = rows["reference"]["curve"][0][1]
    assert rows["platform"]["curve"][0][1] == pytest.approx(start)
    assert abs(rows["reference"]["val_loss"] - start) > 1e-2, "the reference did not train: the comparison would be vacuous"
    assert rows["single"]["val_loss"] < start
    assert got["platform_over_reference"] == pytest.approx(1.0, abs=1e-4)
    assert rows["platform"]["tokens"] == rows["reference"]["tokens"] == 8 * rows["single"]["tokens"]


@pytest.mark.parametrize("workers", ["0", "1"], ids=["one-process", "xdist"])
def test_the_cuda_tests_record_survives_a_step_killed_at_its_cap(tmp_path, workers):
    """The GPU suite kills a step at its cap: the plugin's record, written after every test by the process that sees
    every report (the xdist controller, the suite's way), still says what passed, that the run did not complete, and
    which selected tests never ran."""
    (tmp_path / "test_gpu_like.py").write_text(
        "import os, signal, pytest\n"
        "@pytest.mark.skipif(False, reason='needs a CUDA device')\n"
        "def test_a_passes():\n    assert True\n"
        "@pytest.mark.skipif(False, reason='needs a GPU')\n"
        "def test_b_is_killed():\n"
        "    parent = open(f'/proc/{os.getppid()}/cmdline', 'rb').read()\n"
        "    if os.environ.get('PYTEST_XDIST_WORKER') and b'test_gpu_like.py' in parent:\n"
        "        os.kill(os.getppid(), signal.SIGKILL)  # the run's controller\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "@pytest.mark.skipif(False, reason='needs a GPU')\n"
        "def test_c_never_runs():\n    assert True\n"
        "def test_d_is_not_a_gpu_test():\n    assert True\n")
    record = tmp_path / "cuda_tests.json"
    # Not this suite's own xdist variables: the one-process run would take itself for a worker and kill its parent.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, "PYTHONPATH": str(BENCH),
           "CUDA_TESTS_JSON": str(record)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", workers, "-p", "no:cacheprovider", "-p", "cuda_tests",
                          "test_gpu_like.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stdout + out.stderr
    got = json.loads(record.read_text())
    assert got["tests"] == {"test_gpu_like.py::test_a_passes": "passed"}
    assert got["complete"] is False and got["exit_status"] is None and got["goal"]["pass"] is False
    assert got["not_run"] == ["test_gpu_like.py::test_b_is_killed", "test_gpu_like.py::test_c_never_runs"]


def test_the_cuda_tests_plugin_keeps_only_the_gpu_tests_and_the_suite_collects_every_file_that_has_one():
    """The plugin, collecting the whole test folder, keeps only tests whose skip names CUDA or a GPU; the files the GPU
    suite collects (read from their source, never imported) are exactly the files of those tests."""
    sys.path.insert(0, str(BENCH))
    try:
        from cuda_tests import gpu_test_files
    finally:
        sys.path.remove(str(BENCH))
    env = {**os.environ, "PYTHONPATH": str(BENCH)}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "cuda_tests", "tests"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    kept = [line for line in out.stdout.splitlines() if "::" in line]
    assert kept and all(re.search(r"cuda|gpu", line, re.I) for line in kept), kept
    assert "deselected" in out.stdout
    # A skipif laid over two lines (a pytest.param's mark) and a reason kept in a name are both found.
    files = {str(p.relative_to(ROOT)) for p in gpu_test_files(ROOT / "tests")}
    assert {"tests/test_compact_downloads.py", "tests/test_ddp_learner.py"} <= files
    assert files == {line.split("::")[0] for line in kept}
