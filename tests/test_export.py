"""ddiloco export and model.init_from: a tiny Llama trained in process, exported, loaded back with from_pretrained."""

from __future__ import annotations

import uuid
from contextlib import ExitStack

import pytest
import torch
import torch.nn.functional as F
from support import TINY_LLAMA
from typer.testing import CliRunner

from ddiloco.inprocess import SimClock, sim_learner, sim_step
from ddiloco.platform.config import build_config
from ddiloco.platform.data import build_dataset
from ddiloco.platform.ledger import errors as errors_q
from ddiloco.platform.ledger import make_engine
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.models.weights import WeightsError, read_weights
from ddiloco.platform.run_state import build_layout, read_version, register_run
from ddiloco.platform.runtime import RunContext
from ddiloco.synchronizer.evaluation import evaluate_global, newest_params
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.testing.postgres import scratch_database

transformers = pytest.importorskip("transformers")



def run_config(ledger_url: str, store_url: str, name: str = "hf-run", **model):
    return build_config(
        {
            "name": name,
            "model": {"kind": "hf", "hf_config": TINY_LLAMA, "vocab_size": 256, "seq_len": 32, **model},
            "data": {"max_bytes": 200_000, "val_batches": 2},
            "learners": {"regions": [{"name": "us", "learners": 2}], "batch_size": 4},
            "fragments": {"count": 4},
            "compression": {"codec": "none"},
            # One process on a simulated clock: no session can be left by a dead learner, and the limit meant for one
            # ended this test's transactions when a loaded machine paused it for 5 s.
            "ledger": {"url": ledger_url, "idle_in_transaction_timeout_s": None},
            "storage": {"url": store_url},
        }
    )


def train(cfg, steps: int = 10) -> RunContext:
    """A short real run in process: a synchronizer and two learners on a simulated clock."""
    clock = SimClock()
    ctx = RunContext.open(cfg, clock=clock)
    sync = Synchronizer(ctx, holder="sync-test")
    sync.simulated_time = True
    sync.poll_once(clock.t)
    learners = [sim_learner(ctx, lid) for lid, _, _ in cfg.learners.learner_ids()]
    for learner in learners:
        learner.start(clock.t)
    for _ in range(steps):
        clock.t += 1.0
        for learner in learners:
            sim_step(learner, clock.t)
        sync.poll_once(clock.t)
    sync.poll_once(clock.t, drain=True)
    return ctx


def val_loss_of(model, cfg) -> float:
    """Token-weighted next-token cross-entropy of a transformers model on the run's validation batches (no ddiloco code)."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for b in build_dataset(cfg.data, cfg.model).val_batches(cfg.learners.batch_size):
            logits = model(input_ids=b.inputs).logits
            total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), b.targets.reshape(-1))) * b.tokens
            tokens += b.tokens
    return total / tokens


@pytest.fixture(scope="module", params=[(ledger, store) for ledger in ("sqlite", "postgres") for store in ("file", "memory", "s3")],
                ids=lambda p: "-".join(p))
def trained(request, tmp_path_factory):
    """One short run per ledger and store kind, trained once for the module's export tests: (its config, its context)."""
    ledger, store = request.param
    tmp = tmp_path_factory.mktemp(f"export-{ledger}-{store}")
    with ExitStack() as stack:
        if ledger == "sqlite":
            ledger_url = f"sqlite:///{tmp}/ledger.db"
        else:
            ledger_url = stack.enter_context(scratch_database(request.getfixturevalue("postgres_url")))
        if store == "file":
            store_url = f"file://{tmp}/store"
        elif store == "memory":
            store_url = f"memory://export-{uuid.uuid4().hex}"
        else:
            import s3fs

            request.getfixturevalue("s3_endpoint")
            bucket = f"b-{uuid.uuid4().hex[:12]}"
            s3fs.S3FileSystem().mkdir(bucket)
            store_url = f"s3://{bucket}/root"
        cfg = run_config(ledger_url, store_url)
        ctx = train(cfg)
        yield cfg, ctx
        ctx.engine.dispose()


def test_export_hf_round_trips_through_from_pretrained(trained, tmp_path):
    from ddiloco.export import export_run

    cfg, ctx = trained
    with ctx.reading() as s:
        assert min(runs_q.latest_version_numbers(s, ctx.run_id).values()) >= 1
    done = export_run(ctx, to=str(tmp_path / "out"), fmt="hf")
    assert {"config.json", "model.safetensors", "ddiloco-run.json"} <= set(done.files)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    expected, _ = evaluate_global(cfg, newest_params(ctx))
    assert val_loss_of(hf.eval(), cfg) == pytest.approx(expected, abs=1e-4)


def test_cli_exports_version_n_and_a_new_run_starts_from_it(trained):
    from ddiloco.cli import app

    cfg, ctx = trained
    ledger_url, store_url = cfg.ledger.url.get_secret_value(), cfg.storage.url
    out = f"{store_url}/exports/v1"
    result = CliRunner().invoke(
        app, ["export", "--run", cfg.name, "--ledger", ledger_url, "--store", store_url, "--version", "1", "--format", "safetensors",
              "--to", out],
    )
    assert result.exit_code == 0, result.output
    exported = read_weights(out)
    with ctx.reading() as s:
        rows = [runs_q.get_version(s, ctx.run_id, f, 1) for f in range(4)]
    at_v1: dict[str, torch.Tensor] = {}
    for row in rows:
        at_v1.update(read_version(ctx.store(), row))
    assert set(exported) == set(at_v1)
    assert all(torch.equal(exported[n], at_v1[n]) for n in at_v1)
    again = CliRunner().invoke(app, ["export", "--run", cfg.name, "--ledger", ledger_url, "--store", store_url, "--to", out])
    assert again.exit_code == 2 and "never overwrites" in again.output

    # A new run in the same ledger and store, initialised from the export: its version 0 is the export.
    fresh = run_config(ledger_url, store_url, name="from-export", init_from=out)
    ctx2 = RunContext.open(fresh, clock=SimClock())
    Synchronizer(ctx2, holder="sync-init").poll_once(ctx2.now())
    v0 = newest_params(ctx2)
    assert set(v0) == set(exported) and all(torch.equal(v0[n], exported[n]) for n in exported)
    ctx2.engine.dispose()


def test_export_refuses_what_it_cannot_write(tmp_path):
    from ddiloco.export import ExportError, export_run

    cfg = build_config({"name": "gpt-run", "model": {"seq_len": 16, "d_model": 16, "n_head": 2}, "fragments": {"count": 4},
                        "data": {"max_bytes": 100_000}, "learners": {"regions": [{"name": "us", "learners": 1}], "batch_size": 2},
                        "ledger": {"url": f"sqlite:///{tmp_path}/l.db"}, "storage": {"url": f"file://{tmp_path}/store"}})
    ctx = RunContext.open(cfg, clock=SimClock())
    with pytest.raises(errors_q.UnknownRunError, match="is not in the ledger"):
        export_run(ctx, to=str(tmp_path / "a"))
    register_run(ctx, build_layout(ctx))
    with pytest.raises(ExportError, match="has no published global version"):
        export_run(ctx, to=str(tmp_path / "a"))
    Synchronizer(ctx, holder="s").poll_once(ctx.now())
    with pytest.raises(ExportError, match="--format hf needs model.kind 'hf'"):
        export_run(ctx, to=str(tmp_path / "b"), fmt="hf")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("x")
    with pytest.raises(ExportError, match="never overwrites"):
        export_run(ctx, to=str(tmp_path / "c"))
    # A read-only ledger is enough.
    ro = RunContext(cfg=cfg, run_id=cfg.name, engine=make_engine(cfg.ledger.url, read_only=True))
    assert export_run(ro, to=str(tmp_path / "d"), version=0).versions == {0: 0, 1: 0, 2: 0, 3: 0}


def test_init_from_refuses_bad_weights(tmp_path):
    with pytest.raises(WeightsError, match="no such file or directory"):
        read_weights(str(tmp_path / "missing"))
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(WeightsError, match="never a pickled checkpoint"):
        read_weights(str(tmp_path / "pickled"))
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        read_weights(str(tmp_path / "bad.safetensors"))
    cfg = run_config(f"sqlite:///{tmp_path}/l.db", f"file://{tmp_path}/store", init_from=str(tmp_path / "missing"))
    with pytest.raises(WeightsError, match="model.init_from"):
        Synchronizer(RunContext.open(cfg, clock=SimClock()), holder="s").poll_once(0.0)


def test_a_synchronizer_with_unreadable_init_from_stops_with_one_line(tmp_path):
    """A config error does not get better by retrying: the process says so once and exits 2."""
    import subprocess
    import sys

    import yaml

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"name": "bad-init", "ledger": {"url": f"sqlite:///{tmp_path}/l.db"},
                                      "storage": {"url": f"file://{tmp_path}/store"}}))
    done = subprocess.run(
        [sys.executable, "-m", "ddiloco", "synchronizer", "-c", str(config), "--init-from", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: model.init_from" in done.stdout + done.stderr and "no such file or directory" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_an_hf_export_copies_the_tokenizer_files_only(tmp_path):
    """data.tokenizer may name the folder data prepare wrote: tokenizer.json beside the token shards."""
    from ddiloco.export import ExportError, _tokenizer_files

    folder = tmp_path / "prepared"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "manifest.json", "train-00000.bin", "val.bin"):
        (folder / name).write_text("x")
    cfg = build_config({"data": {"tokenizer": str(folder)}})
    assert sorted(name for _, name in _tokenizer_files(cfg)) == ["tokenizer.json", "tokenizer_config.json"]
    single = build_config({"data": {"tokenizer": str(folder / "tokenizer.json")}})
    assert [name for _, name in _tokenizer_files(single)] == ["tokenizer.json"]
    with pytest.raises(ExportError, match="does not exist"):
        _tokenizer_files(build_config({"data": {"tokenizer": str(tmp_path / "gone")}}))
