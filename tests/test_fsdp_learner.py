"""A sharded learner (FSDP2 over gloo ranks on CPU) is interchangeable with a DDP one and with a one-process one.

The fragment plan is over full parameter names: each rank works on its rows of every fragment and rank 0 gathers
them, so what reaches the store does not depend on how the replica is spread over the ranks."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import TINY_LLAMA, tiny_config
from test_ddp_learner import STEPS, B, _concat, _drive, _full, _ledger_view, _open_run, _submission_blobs, run_two_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from ddiloco.inprocess import sim_learner
from ddiloco.learner_worker.parallel import (
    Layout,
    blocks,
    cache_off_advice,
    checkpoint_blocks,
    gather_pieces,
    gather_sizes,
    local_pieces,
    shard_rows,
)
from ddiloco.platform.config import ConfigError
from ddiloco.platform.data import Batch
from ddiloco.platform.fragments import Fragment, Piece, piece_key
from ddiloco.platform.models import build_model, training_loss
from ddiloco.platform.models.cost import state_bytes_per_rank


def _config(parallelism: str, learners: int = 1, shard_size: int | None = None, activation: str = "none", **extra):
    return tiny_config(
        learners={"batch_size": B, "regions": [{"name": "us", "learners": learners}], "parallelism": parallelism,
                  "shard_size": shard_size, "activation_checkpoint": activation},
        synchronizer={"retention": {"keep_last": 100000, "keep_submission_blobs": True}},
        **extra,
    )


def test_shard_rows_cut_like_torch_chunk():
    for rows in (1, 2, 5, 7, 32, 33):
        for shards in (1, 2, 3, 4, 8):
            want = [c.shape[0] for c in torch.arange(rows).chunk(shards)]
            got = [shard_rows(rows, shards, i) for i in range(shards)]
            assert [b - a for a, b in got if b > a] == want
            assert got[0][0] == 0 and got[-1][1] == rows
            assert all(got[i][1] == got[i + 1][0] for i in range(shards - 1))


def test_local_pieces_hold_this_ranks_rows_of_each_piece():
    w = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)
    frag = Fragment(0, (Piece(piece_key("w", (2, 6)), "w", (2, 6), (4, 3), 12, 48),), 12, 48)
    shapes = {"w": w.shape}
    for shard in range(2):
        layout = Layout("fsdp", shards=2, shard=shard)
        r0, r1 = shard_rows(7, 2, shard)  # rows 0:4, 4:7
        (pc,) = local_pieces(frag, {"w": w[r0:r1]}, shapes, layout)
        rows = range(max(2, r0), min(6, r1))
        assert pc.key == piece_key("w", (2, 6)) and pc.rows == len(rows) and pc.first == rows[0] - 2
        assert torch.equal(pc.view, w[rows[0] : rows[-1] + 1])
    sizes = gather_sizes(frag, shapes, Layout("fsdp", shards=2, shard=0))
    assert sizes == [[2 * 3], [2 * 3]] and sum(map(sum, sizes)) == 4 * 3


def test_an_unsharded_send_hands_its_increment_over_without_copying_it():
    """One process (or DDP): the increment's tensors themselves go to the link, with no device op on the way."""
    rows = [torch.randn(4, 3), torch.randn(5)]
    shapes = [torch.Size([4, 3]), torch.Size([5])]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        whole = gather_pieces(rows, ["a", "b"], shapes, [[12, 5]], Layout("ddp"), True)
    assert whole is not None and [t.data_ptr() for t in whole.values()] == [t.data_ptr() for t in rows]
    copies = sorted({e.name for e in prof.events() if e.name in ("aten::cat", "aten::copy_", "aten::clone", "aten::empty")})
    assert copies == [], copies
    assert gather_pieces(rows, ["a", "b"], shapes, [[12, 5]], Layout("ddp"), False) is None


def test_blocks_are_the_models_repeated_layers():
    model = build_model(tiny_config(model={"n_layer": 3}).model)
    got = blocks(model)
    assert len(got) == 3 and all(type(b) is type(got[0]) for b in got)


def _backward(model: torch.nn.Module, vocab: int, seq: int, compiled: bool = False,
              ) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of a fixed batch: (bytes the forward kept for the backward, loss, gradients)."""
    g = torch.Generator().manual_seed(7)
    x, y = (torch.randint(0, vocab, (4, seq), generator=g) for _ in range(2))
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = training_loss(torch.compile(model) if compiled else model, Batch(inputs=x, targets=y, tokens=x.numel()))
    loss.backward()
    return saved, loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["gpt", "moe_gpt", "hf", "torchtitan"])
def test_activation_checkpointing_recomputes_every_block_and_changes_no_number(kind):
    if kind == "torchtitan" and importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed")
    cfg = tiny_config(model=KINDS[kind]).model
    plain, ckpt = build_model(cfg, seed=0), build_model(cfg, seed=0)
    assert checkpoint_blocks(ckpt) == len(blocks(plain)) == 2
    clone = copy.deepcopy(ckpt)
    assert [n for n, _ in ckpt.named_parameters()] == [n for n, _ in plain.named_parameters()], "the fragment plan's names"
    kept_plain, loss_plain, grads_plain = _backward(plain, cfg.vocab_size, cfg.seq_len)
    kept, loss, grads = _backward(ckpt, cfg.vocab_size, cfg.seq_len)
    # Only each block's inputs are kept (and what lies outside the blocks); the blocks' intermediates are recomputed.
    assert kept < kept_plain / 2, (kept, kept_plain)
    assert torch.equal(loss, loss_plain)
    assert grads.keys() == grads_plain.keys()
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}")
    # A deep copy (its class goes with it) recomputes too; a second call does not nest a second recomputation.
    assert _backward(clone, cfg.vocab_size, cfg.seq_len)[0] == kept
    checkpoint_blocks(ckpt)
    assert [type(b).__mro__[1] for b in blocks(ckpt)] == [type(b) for b in blocks(plain)]


def _ops_in_backward(model: torch.nn.Module, vocab: int, seq: int) -> tuple[int, int]:
    """(matrix products, all ops) run by one backward pass: its own, and any of the forward it runs again."""
    g = torch.Generator().manual_seed(7)
    x, y = (torch.randint(0, vocab, (4, seq), generator=g) for _ in range(2))
    loss = training_loss(model, Batch(inputs=x, targets=y, tokens=x.numel()))
    products = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    ran: list = []

    class Ran(TorchDispatchMode):
        # Entered before the backward, so below the recomputation's own mode: it sees only the ops really run, not
        # those whose kept outputs the recomputation hands back.
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
            ran.append(func)
            return func(*args, **(kwargs or {}))

    with Ran():
        loss.backward()
    return sum(1 for f in ran if f in products), len(ran)


@pytest.mark.parametrize("kind", ["gpt", "moe_gpt", "hf", "torchtitan"])
def test_selective_checkpointing_keeps_the_products_recomputes_the_rest_and_changes_no_number(kind):
    if kind == "torchtitan" and importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed")
    cfg = tiny_config(model=KINDS[kind]).model
    plain, full, selective = (build_model(cfg, seed=0) for _ in range(3))
    assert checkpoint_blocks(full, "full") == checkpoint_blocks(selective, "selective") == 2
    assert all(type(b).__name__.startswith("SelectivelyCheckpointed") for b in blocks(selective))
    assert [n for n, _ in selective.named_parameters()] == [n for n, _ in plain.named_parameters()], "the fragment plan's names"
    _, loss_plain, grads_plain = _backward(plain, cfg.vocab_size, cfg.seq_len)
    _, loss, grads = _backward(selective, cfg.vocab_size, cfg.seq_len)
    assert torch.equal(loss, loss_plain)
    assert grads.keys() == grads_plain.keys()
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}")
    # Its backward runs no matrix product again (the full recomputation runs each block's forward ones) but does run
    # the rest of the blocks' forward again (the plain backward runs none of it).
    (mm_plain, ops_plain), (mm, ops), (mm_full, ops_full) = (_ops_in_backward(m, cfg.vocab_size, cfg.seq_len)
                                                              for m in (plain, selective, full))
    assert mm == mm_plain < mm_full, (mm_plain, mm, mm_full)
    assert ops_plain < ops < ops_full, (ops_plain, ops, ops_full)
    # Asked again, or for the other mode, a block keeps the recomputation it has: none is nested.
    checkpoint_blocks(selective, "full")
    assert [type(b).__mro__[1] for b in blocks(selective)] == [type(b) for b in blocks(plain)]
    with pytest.raises(ConfigError, match="'partial' is not none, full or selective"):
        checkpoint_blocks(plain, "partial")


def test_an_eager_hugging_face_learner_with_its_cache_off_on_a_gpu_is_told_to_compile():
    """Its cache off, transformers reads a value back from the device in every forward; only that case is warned."""
    hf, recomputing, gpt = (build_model(tiny_config(model=KINDS[k]).model) for k in ("hf", "hf", "gpt"))
    checkpoint_blocks(recomputing, "selective")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cache_off_advice(hf, cuda, compiled=False) is None  # its cache on: nothing read back
    advice = cache_off_advice(recomputing, cuda, compiled=False)
    assert advice and "learners.compile: true" in advice and ".all()" in advice
    assert cache_off_advice(recomputing, cuda, compiled=True) is None
    assert cache_off_advice(recomputing, cpu, compiled=False) is None
    hf.config.use_cache = False  # a config that turns it off itself gets the same advice
    assert cache_off_advice(hf, cuda, compiled=False) == advice
    assert cache_off_advice(gpt, cuda, compiled=False) is None


def test_a_compiled_model_recomputes_its_checkpointed_blocks_and_trains_as_the_eager_one():
    torch._dynamo.reset()
    cfg = tiny_config(model={"n_layer": 2}).model
    eager, ckpt = build_model(cfg, seed=0), build_model(cfg, seed=0)
    checkpoint_blocks(ckpt)
    kept_eager, loss_eager, grads_eager = _backward(eager, cfg.vocab_size, cfg.seq_len)
    kept, loss, grads = _backward(ckpt, cfg.vocab_size, cfg.seq_len, compiled=True)
    # Compiled, this model keeps 0.97x what the eager one keeps without checkpointing and 0.47x with it (the
    # embedding, head and loss outside the blocks are a large share at this size).
    assert kept < 0.75 * kept_eager, (kept, kept_eager)
    torch.testing.assert_close(loss, loss_eager, rtol=1e-5, atol=1e-6)
    for name, g in grads_eager.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_activation_checkpointing_is_refused_for_a_model_without_repeated_blocks():
    with pytest.raises(ConfigError, match="learners.activation_checkpoint: SmallCNN has no repeated blocks"):
        checkpoint_blocks(build_model(tiny_config(model={"kind": "vision"}).model))
    for mode in ("full", "selective"):
        with pytest.raises(ValueError, match="model.kind vision has no repeated blocks"):
            tiny_config(model={"kind": "vision"}, learners={"activation_checkpoint": mode})


@pytest.mark.slow
def test_two_rank_fsdp_sends_what_two_rank_ddp_recomputing_its_activations_sends(tmp_path):
    """The DDP learner recomputes its blocks' activations in the backward pass (``activation_checkpoint: full``),
    under DDP's gradient hooks, and the FSDP learner all but their matrix products and attention (``selective``),
    inside its units' hooks: neither may change anything either computes. (FSDP with ``full`` is the HSDP test's.)"""
    ddp = run_two_ranks(tmp_path / "ddp", _config("ddp", activation="full"))
    fsdp = run_two_ranks(tmp_path / "fsdp", _config("fsdp", activation="selective"))
    assert [r["checkpointed_blocks"] for r in ddp + fsdp] == [1, 1, 1, 1]
    assert all(name.startswith("Checkpointed") for r in ddp for name in r["block_classes"]), ddp[0]["block_classes"]
    assert all(r["block_classes"] == ["FSDPSelectivelyCheckpointedBlock"] for r in fsdp), fsdp[0]["block_classes"]
    # FSDP really shards: each rank holds about half of the rows, DDP every row.
    assert ddp[0]["shards"] == 1 and fsdp[0]["shards"] == fsdp[1]["shards"] == 2
    assert ddp[0]["local_numel"] == ddp[0]["numel"]
    assert fsdp[0]["local_numel"] + fsdp[1]["local_numel"] == fsdp[0]["numel"]
    assert 0 < fsdp[1]["local_numel"] < fsdp[0]["numel"]
    # The float32 state `ddiloco config` sizes a rank by: all of it on each DDP rank, a row shard of it on each FSDP
    # rank, within a row of the even split.
    numel = ddp[0]["numel"]
    assert ddp[0]["state_bytes"] == ddp[1]["state_bytes"] == state_bytes_per_rank(numel, "ddp", 2)
    assert fsdp[0]["state_bytes"] + fsdp[1]["state_bytes"] == state_bytes_per_rank(numel, "ddp", 1)
    assert all(abs(r["state_bytes"] - state_bytes_per_rank(numel, "fsdp", 2)) < 0.1 * state_bytes_per_rank(numel, "fsdp", 2)
               for r in fsdp), [r["state_bytes"] for r in fsdp]
    # The same submissions and versions, several sends and receipts.
    a, b = ddp[0]["ledger"], fsdp[0]["ledger"]
    assert a["submissions"] == b["submissions"] and a["versions"] == b["versions"]
    assert len(a["submissions"]) == STEPS and sum(ddp[0]["base"]) >= 3 and fsdp[0]["base"] == ddp[0]["base"]
    assert fsdp[0]["tokens_total"] == ddp[0]["tokens_total"] == STEPS * 2 * B * 32
    # The outer gradients sent agree to float tolerance (the reductions' order differs: not bit for bit). An outer
    # gradient is a difference of parameters, so it gets the parameters' tolerance: AdamW turns a reduction-order
    # difference in a near-zero gradient into an update difference near the learning rate's scale (1.2e-6 seen on
    # an AVX-512 machine, where 1e-6 had held on an AVX2 one).
    assert ddp[0]["blobs"].keys() == fsdp[0]["blobs"].keys()
    for uid, values in ddp[0]["blobs"].items():
        got = torch.tensor(fsdp[0]["blobs"][uid])
        assert got.abs().max() > 0, uid
        torch.testing.assert_close(got, torch.tensor(values), rtol=1e-4, atol=1e-5, msg=lambda m, u=uid: f"{u}: {m}")
    torch.testing.assert_close(torch.tensor(fsdp[0]["losses"]), torch.tensor(ddp[0]["losses"]), rtol=1e-5, atol=1e-6)
    assert fsdp[0]["losses"] == fsdp[1]["losses"]
    want = load_file(str(tmp_path / "ddp" / "params-0.safetensors"))
    for r in range(2):
        got = load_file(str(tmp_path / "fsdp" / f"params-{r}.safetensors"))
        for name, t in want.items():
            torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_a_one_process_learner_and_a_two_rank_fsdp_learner_merge_together(tmp_path):
    ranks = run_two_ranks(tmp_path / "mixed", _config("fsdp", learners=2, quorum={"min_count": 2}))
    assert ranks[0]["shards"] == 2
    subs = ranks[0]["ledger"]["submissions"]
    # [uid, fragment, base, c_steps, c_tokens, tokens_new, status, merged_version, learner]
    per_step = {s[8]: s[4] / s[3] for s in subs if s[3]}
    assert per_step == {"us-0": 2 * B * 32, "us-1": B * 32}, "the 2-rank learner trains twice the tokens a step"
    merged_by: dict[tuple[int, int], set[str]] = {}
    for s in subs:
        if s[6] == "merged":
            merged_by.setdefault((s[1], s[7]), set()).add(s[8])
    # With a quorum of two, versions merge both learners' work: the two layouts' blobs merge together.
    both = [v for v, who in merged_by.items() if who == {"us-0", "us-1"}]
    assert len(both) >= 2, merged_by
    assert not [s for s in subs if s[6] == "rejected"]


@pytest.mark.slow
def test_four_rank_hsdp_of_two_groups_sends_what_one_rank_with_four_times_the_batch_sends(tmp_path):
    """HSDP: 2 replica groups of 2 shards. Only rank 0's group gathers; the other group keeps its snapshots in step.
    Its blocks recompute their activations in the backward pass (``activation_checkpoint: full``) inside their FSDP
    units, the reference's do not: that must change nothing either.

    The reference is one process training the four ranks' batches as one (as DDP does: ``test_ddp_learner``
    holds two DDP ranks to one rank with twice the batch), so three more rank processes are not needed for it."""
    cfg = _config("hsdp", shard_size=2, activation="full")
    hsdp = run_two_ranks(tmp_path / "hsdp", cfg, world=4)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    _, clock, ctx, sync = _open_run(ref_dir, cfg.model_copy(update={"learners": cfg.learners.model_copy(
        update={"batch_size": 4 * B, "parallelism": "ddp", "shard_size": None, "activation_checkpoint": "none"})}))
    ref = sim_learner(ctx, "us-0", index=0, num_learners=1)
    ref.start(clock.t)
    seed = cfg.seed * 1_000_003 + ref.incarnation
    ref._batches = _concat(*(ref.dataset.train_batches(r, 4, B, seed=seed) for r in range(4)))
    ref_losses = _drive(ref, sync, clock, STEPS)
    ref_ledger, ref_blobs = _ledger_view(ctx), _submission_blobs(ctx)

    assert [r["shards"] for r in hsdp] == [2, 2, 2, 2] and [r["checkpointed_blocks"] for r in hsdp] == [1] * 4
    # FSDP2 made its own subclass of the recomputing one: both are in force.
    assert all(r["block_classes"] == ["FSDPCheckpointedBlock"] for r in hsdp), hsdp[0]["block_classes"]
    assert ref.checkpointed_blocks == 0
    # Ranks 0 and 2 hold the same rows (shard 0 of each group), 1 and 3 the rest.
    assert hsdp[0]["local_numel"] == hsdp[2]["local_numel"] and hsdp[1]["local_numel"] == hsdp[3]["local_numel"]
    assert hsdp[0]["local_numel"] + hsdp[1]["local_numel"] == hsdp[0]["numel"]
    assert hsdp[0]["ledger"]["submissions"] == ref_ledger["submissions"] and len(ref_ledger["submissions"]) == STEPS
    assert hsdp[0]["ledger"]["versions"] == ref_ledger["versions"] and sum(hsdp[0]["base"]) >= 3
    assert [r["base"] for r in hsdp] == [ref.base] * 4
    assert [r["tokens_total"] for r in hsdp] == [ref.tokens_total] * 4 == [STEPS * 4 * B * cfg.model.seq_len] * 4
    torch.testing.assert_close(torch.tensor(hsdp[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert ref_blobs.keys() == hsdp[0]["blobs"].keys()
    for uid, values in ref_blobs.items():
        torch.testing.assert_close(torch.tensor(hsdp[0]["blobs"][uid]), torch.tensor(values), rtol=1e-4, atol=1e-6)
    want = {n: p.detach() for n, p in ref.model.named_parameters()}
    for r in range(4):
        got = load_file(str(tmp_path / "hsdp" / f"params-{r}.safetensors"))
        assert got.keys() == want.keys()
        for name, t in want.items():
            torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-5, msg=lambda m, n=name, r=r: f"rank {r} {n}: {m}")


KINDS = {
    "gpt": {"kind": "gpt", "n_layer": 2},
    "moe_gpt": {"kind": "moe_gpt", "n_layer": 2},
    "hf": {"kind": "hf", "hf_config": dict(TINY_LLAMA), "vocab_size": 256},
    "torchtitan": {"kind": "torchtitan", "titan_args": {"dim": 32, "n_layers": 2, "n_heads": 4, "multiple_of": 32},
                   "vocab_size": 256},
}


def kinds_main(out: Path) -> None:
    """Every model kind as a one-rank FSDP learner and as a plain one, side by side on the simulated clock (a process
    of its own: FSDP needs a process group, which a test process must not be left holding)."""
    from support import sim_run
    from torch._dynamo.utils import counters

    from ddiloco.inprocess import sim_step

    torch.set_num_threads(1)
    report = {}
    for name, model in KINDS.items():
        if name == "torchtitan" and importlib.util.find_spec("torchtitan") is None:
            continue
        finals = {}
        # The gpt also as torchtitan stacks a replica: blocks recomputing, the whole module compiled, FSDP2.
        for variant in ("ddp", "fsdp", "fsdp_recompute", *(("fsdp_recompute_compiled",) if name == "gpt" else ())):
            parallelism = variant.split("_")[0]
            _cfg, clock, ctx, sync = sim_run(model=model, learners={
                "parallelism": parallelism, "regions": [{"name": "us", "learners": 1}],
                "activation_checkpoint": "full" if "recompute" in variant else "none", "compile": "compiled" in variant})
            graphs = counters["stats"]["unique_graphs"]
            learner = sim_learner(ctx, "us-0")
            learner.start(clock.t)
            losses = []
            for _ in range(8):
                clock.t += 1.0
                losses.append(sim_step(learner, clock.t).loss)
                sync.poll_once(clock.t)
            finals[variant] = {
                "losses": losses, "base": learner.base, "sharded": learner.layout.parallelism,
                "checkpointed_blocks": learner.checkpointed_blocks,
                "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
                "params": {n: _full(p).reshape(-1)[:64].tolist() for n, p in learner.model.named_parameters()},
            }
        report[name] = finals
    out.write_text(json.dumps(report))


def test_every_model_kind_trains_and_trades_fragments_as_an_fsdp_learner(tmp_path):
    out = tmp_path / "kinds.json"
    proc = subprocess.run([sys.executable, __file__, "kinds", str(out)], capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).parent, env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"gpt", "moe_gpt", "hf"} <= set(report)
    for name, runs in report.items():
        plain = runs["ddp"]
        assert plain["sharded"] == "ddp" and plain["checkpointed_blocks"] == 0 and plain["graphs_compiled"] == 0
        # FSDP2, FSDP2 with each block recomputing its activations in the backward pass, and (gpt) that compiled,
        # train as the plain learner (compiled: to float tolerance, inductor reorders float32 sums).
        assert set(runs) == {"ddp", "fsdp", "fsdp_recompute", *(("fsdp_recompute_compiled",) if name == "gpt" else ())}
        for variant in set(runs) - {"ddp"}:
            fsdp = runs[variant]
            assert fsdp["sharded"] == "fsdp", (name, variant)
            assert fsdp["checkpointed_blocks"] == (2 if "recompute" in variant else 0), (name, variant)
            assert (fsdp["graphs_compiled"] > 0) == ("compiled" in variant), (name, variant, fsdp["graphs_compiled"])
            assert min(fsdp["base"]) >= 1, f"{name} {variant}: every fragment merged and came back"
            assert fsdp["base"] == plain["base"]
            torch.testing.assert_close(torch.tensor(fsdp["losses"]), torch.tensor(plain["losses"]), rtol=1e-4,
                                       atol=1e-5, msg=lambda m, n=name, v=variant: f"{n} {v}: {m}")
            for p, values in plain["params"].items():
                torch.testing.assert_close(torch.tensor(fsdp["params"][p]), torch.tensor(values), rtol=1e-4, atol=1e-5,
                                           msg=lambda m, n=name, v=variant, p=p: f"{n} {v} {p}: {m}")


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "kinds":
    kinds_main(Path(sys.argv[2]))
