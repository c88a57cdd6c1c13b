from __future__ import annotations

import pytest
import torch

from ddiloco.platform.compression import decode_delta, encode_delta
from ddiloco.platform.config import ModelConfig
from ddiloco.platform.fragments import (
    SPLIT_ABOVE,
    PieceKeyError,
    assemble,
    due_fragments,
    fragment_views,
    imbalance,
    param_name,
    parse_key,
    partition,
    partition_module,
    split,
)
from ddiloco.platform.models import build_model
from ddiloco.synchronizer.merge import MergePolicy, plain_mean_tensors


def test_partition_literal_case() -> None:
    shapes = [("a", (10,), 4), ("b", (6,), 4), ("c", (5,), 4), ("d", (4,), 4), ("e", (3,), 4)]
    frags = partition(shapes, 2)
    # a(10) -> f0; b(6) -> f1; c(5) -> f1 (6 < 10); d(4) -> f0 (10 < 11); e(3) -> f1 (11 < 14)
    assert [(f.index, f.keys, f.numel, f.nbytes) for f in frags] == [(0, ("a", "d"), 14, 56), (1, ("b", "c", "e"), 14, 56)]
    assert all(pc.rows is None and pc.key == pc.name for f in frags for pc in f.pieces)
    assert imbalance(frags) == 1.0


def test_partition_keeps_model_order_and_uses_bytes_per_element() -> None:
    # z is last in the model but largest; names inside a fragment follow the model's order.
    shapes = [("x", (2, 2), 4), ("y", (8,), 2), ("z", (3, 3), 4)]
    frags = partition(shapes, 2)
    assert [f.names for f in frags] == [("z",), ("x", "y")]
    assert [f.nbytes for f in frags] == [36, 32]
    assert [f.numel for f in frags] == [9, 12]


def test_partition_ties_by_index_and_is_deterministic() -> None:
    shapes = [(f"t{i}", (4,), 4) for i in range(6)]
    a = partition(shapes, 3)
    assert [f.names for f in a] == [("t0", "t3"), ("t1", "t4"), ("t2", "t5")]
    assert a == partition(list(shapes), 3)


def test_partition_zero_sized_tensors_never_leave_a_fragment_empty() -> None:
    shapes = [("a", (0,), 4), ("b", (0,), 4), ("c", (0,), 4)]
    assert all(f.names for f in partition(shapes, 3))


def test_partition_count_errors() -> None:
    with pytest.raises(ValueError, match=r"fragments.count \(4\).*\(3 after splitting"):
        partition([("a", (1,), 4), ("b", (1,), 4), ("c", (1,), 4)], 4)
    with pytest.raises(ValueError, match="fragments.count"):
        partition([("a", (1,), 4)], 0)
    with pytest.raises(ValueError, match="unique"):
        partition([("a", (1,), 4), ("a", (2,), 4)], 1)
    with pytest.raises(ValueError, match="'@'"):
        partition([("a@rows:0:1", (1,), 4)], 1)


def test_partition_single_fragment_holds_everything() -> None:
    model = build_model(ModelConfig(n_layer=1, d_model=32, n_head=2, seq_len=16))
    (frag,) = partition_module(model, 1)
    assert frag.names == tuple(n for n, _ in model.named_parameters())
    assert frag.numel == sum(p.numel() for p in model.parameters())


def test_partition_balance_on_default_gpt() -> None:
    model = build_model(ModelConfig())
    params = dict(model.named_parameters())
    for count in (4, 24):
        frags = partition_module(model, count)
        assert all(f.pieces for f in frags)
        # Every parameter exactly once: whole, or its row pieces put back together.
        rebuilt = assemble({k: v for f in split(params, frags) for k, v in f.items()})
        assert sorted(rebuilt) == sorted(params)
        for n, p in params.items():
            assert torch.equal(rebuilt[n], p.detach()), n
        print(f"P={count}: {len(params)} tensors, {sum(len(f.pieces) for f in frags)} pieces, imbalance {imbalance(frags):.3f}")
    # At P = 4 no tensor is far above the mean: the layout is the whole-tensor one.
    named = [(n, tuple(p.shape), p.element_size()) for n, p in params.items()]
    assert partition(named, 4) == partition(named, 4, split_above=None)
    # At P = 24 whole tensors leave the largest (an MLP matrix, 3.3x the mean) alone in a fragment;
    # row pieces halve that.
    whole, pieces = partition(named, 24, split_above=None), partition(named, 24)
    assert max(f.nbytes for f in whole) == max(p.numel() * p.element_size() for p in model.parameters())
    assert imbalance(whole) > 3.0 and imbalance(pieces) < 1.7


# --- row pieces ---------------------------------------------------------------------------------------


def test_partition_splits_a_tensor_far_above_the_mean_into_row_pieces() -> None:
    # 56 elements over 3 fragments: mean 18.7; emb (40) is 2.1x the mean -> ceil(40 / 18.7) = 3 pieces
    # of rows 0:3, 3:6, 6:10 (12, 12, 16 elements). Greedy: 16 -> f0, 12 -> f1, 12 -> f2, a -> f1, b -> f2.
    shapes = [("emb", (10, 4), 4), ("a", (2, 4), 4), ("b", (2, 4), 4)]
    frags = partition(shapes, 3)
    assert [f.keys for f in frags] == [("emb@rows:6:10",), ("emb@rows:0:3", "a"), ("emb@rows:3:6", "b")]
    assert [f.nbytes for f in frags] == [64, 80, 80]
    assert [f.names for f in frags] == [("emb",), ("emb", "a"), ("emb", "b")]
    assert [pc.shape for f in frags for pc in f.pieces] == [(4, 4), (3, 4), (2, 4), (3, 4), (2, 4)]
    assert frags == partition(list(shapes), 3)
    # Whole tensors only: emb alone is 2.1x the mean.
    assert imbalance(partition(shapes, 3, split_above=None)) > 2.0 > 1.3 > imbalance(frags)


def test_tensors_near_the_mean_one_dimensional_or_short_stay_whole() -> None:
    # mean 32 elements; w is exactly SPLIT_ABOVE (1.25) times the mean, so it stays whole.
    shapes = [("w", (10, 4), 4), ("x", (32,), 4), ("y", (32,), 4), ("z", (24,), 4)]
    assert SPLIT_ABOVE == 1.25
    assert [f.keys for f in partition(shapes, 4)] == [("w",), ("x",), ("y",), ("z",)]
    # A 1-d tensor is never cut, however large; a (2, n) tensor that would need 4 pieces gets one per row.
    shapes = [("bias", (1000,), 4), ("wide", (2, 2000), 4), ("s", (1,), 4), ("t", (1,), 4)]
    keys = {k for f in partition(shapes, 4) for k in f.keys}
    assert keys == {"bias", "wide@rows:0:1", "wide@rows:1:2", "s", "t"}


def test_llama_like_shapes_with_a_128k_vocabulary_balance_at_p24() -> None:
    vocab, d, layers, inter, kv = 128_256, 2048, 16, 8192, 512
    shapes = [("embed_tokens.weight", (vocab, d), 4)]
    for i in range(layers):
        shapes += [(f"l{i}.{n}", s, 4) for n, s in [
            ("ln1", (d,)), ("q", (d, d)), ("k", (kv, d)), ("v", (kv, d)), ("o", (d, d)),
            ("ln2", (d,)), ("gate", (inter, d)), ("up", (inter, d)), ("down", (d, inter)),
        ]]
    shapes += [("norm", (d,), 4), ("lm_head.weight", (vocab, d), 4)]
    whole, frags = partition(shapes, 24, split_above=None), partition(shapes, 24)
    assert imbalance(whole) > 4.0  # the embedding alone is ~4x a fair share
    assert imbalance(frags) < 1.1
    assert len(frags) == 24 and all(f.pieces for f in frags)
    # Only the two vocabulary matrices are cut; their pieces cover every row once.
    pieces = [pc for f in frags for pc in f.pieces if pc.rows is not None]
    assert {pc.name for pc in pieces} == {"embed_tokens.weight", "lm_head.weight"}
    for name in ("embed_tokens.weight", "lm_head.weight"):
        rows = sorted(pc.rows for pc in pieces if pc.name == name)
        assert rows[0][0] == 0 and rows[-1][1] == vocab and all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))
    assert partition(list(shapes), 24) == frags


@pytest.mark.parametrize("key, expected", [
    ("w", ("w", None)),
    ("blocks.0.mlp.fc.weight", ("blocks.0.mlp.fc.weight", None)),
    ("tok_embed.weight@rows:0:128", ("tok_embed.weight", (0, 128))),
    ("e@rows:127:1024", ("e", (127, 1024))),
])
def test_parse_key(key: str, expected: tuple) -> None:
    assert parse_key(key) == expected
    assert param_name(key) == expected[0]


@pytest.mark.parametrize("key", [
    "", "@rows:0:1", "w@rows:1:1", "w@rows:2:1", "w@rows:-1:3", "w@rows:01:3", "w@rows:0:3x", "w@cols:0:3",
    "w@rows:0", "w@rows:0:1:2", "a@b", "w@rows:0:1@rows:0:1", "w@rows:0:" + "9" * 40, "w@rows: 0:1",
])
def test_parse_key_refuses_malformed_keys(key: str) -> None:
    with pytest.raises(PieceKeyError, match="tensor key"):
        parse_key(key)


def test_views_are_live_row_slices_of_the_parameters() -> None:
    emb = torch.nn.Parameter(torch.arange(40, dtype=torch.float32).view(10, 4))
    other = torch.nn.Parameter(torch.ones(2, 4))
    params = {"emb": emb, "a": other}
    frags = partition([("emb", (10, 4), 4), ("a", (2, 4), 4)], 2)
    views = [fragment_views(params, f) for f in frags]
    assert {k for v in views for k in v} == {"emb@rows:0:5", "emb@rows:5:10", "a"}
    piece = next(v for v in views if "emb@rows:5:10" in v)["emb@rows:5:10"]
    assert torch.equal(piece, emb.detach()[5:10])
    # What the learner's receipt does: in-place writes under no_grad land in the parameter.
    with torch.no_grad():
        piece.copy_(torch.full((5, 4), -1.0))
        piece.mul_(2).add_(torch.ones(5, 4), alpha=0.5)
    assert torch.equal(emb.detach()[5:], torch.full((5, 4), -1.5)) and torch.equal(emb.detach()[:5], torch.arange(20.0).view(5, 4))
    # ... and an optimizer's in-place step on the parameter shows through the view.
    emb.grad = torch.ones_like(emb)
    torch.optim.SGD([emb], lr=1.0).step()
    assert torch.equal(piece, torch.full((5, 4), -2.5))
    # The whole tensor's view is the parameter itself.
    assert next(v for v in views if "a" in v)["a"] is other


def test_split_and_assemble_round_trip_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    params = {"emb": torch.randn(1000, 3, generator=g), "w": torch.randn(7, 5, generator=g), "b": torch.randn(5, generator=g)}
    frags = partition([(n, tuple(t.shape), 4) for n, t in params.items()], 4)
    pieces = split(params, frags)
    assert sum(1 for f in pieces for k in f if "@rows:" in k) == 4
    merged = {k: v for f in pieces for k, v in f.items()}
    rebuilt = assemble(merged)
    assert sorted(rebuilt) == sorted(params)
    for n, t in params.items():
        assert torch.equal(rebuilt[n], t)
    # The pieces are copies: changing one leaves the parameters alone.
    before = params["emb"].clone()
    for f in pieces:
        for t in f.values():
            t.add_(1.0)
    assert torch.equal(params["emb"], before)


def test_assemble_refuses_gaps_overlaps_and_mixtures() -> None:
    rows = lambda a, b: torch.zeros(b - a, 2)  # noqa: E731
    with pytest.raises(PieceKeyError, match="gap at row 0"):
        assemble({"e@rows:1:3": rows(1, 3)})
    with pytest.raises(PieceKeyError, match="gap at row 3"):
        assemble({"e@rows:0:3": rows(0, 3), "e@rows:4:6": rows(4, 6)})
    with pytest.raises(PieceKeyError, match="overlap"):
        assemble({"e@rows:0:3": rows(0, 3), "e@rows:2:6": rows(2, 6)})
    with pytest.raises(PieceKeyError, match="both whole and in row pieces"):
        assemble({"e": rows(0, 6), "e@rows:0:6": rows(0, 6)})
    with pytest.raises(PieceKeyError, match="does not hold rows 0:3"):
        assemble({"e@rows:0:3": rows(0, 4)})
    with pytest.raises(PieceKeyError, match="disagree"):
        assemble({"e@rows:0:3": rows(0, 3), "e@rows:3:6": torch.zeros(3, 5)})
    with pytest.raises(PieceKeyError, match="tensor key"):
        assemble({"e@rows:x:6": rows(0, 6)})


def test_row_pieces_compress_like_the_whole_tensor() -> None:
    # Per-tensor int8/int4 blocks restart at each piece; when a piece boundary falls on a block
    # boundary (rows x columns a multiple of the block size) the pieces decode to the whole tensor's rows.
    g = torch.Generator().manual_seed(1)
    whole = {"e": torch.randn(16, 8, generator=g)}
    frags = partition([("e", (16, 8), 4), ("x", (4,), 4), ("y", (4,), 4)], 4)
    pieces = {k: v for f in split(whole | {"x": torch.zeros(4), "y": torch.zeros(4)}, frags) for k, v in f.items() if k.startswith("e@")}
    assert len(pieces) == 4  # 4 rows x 8 = 32 elements each
    for codec in ("bf16", "int8", "int4"):
        want = decode_delta(*encode_delta(whole, codec, block_size=16))["e"]
        enc, meta = encode_delta(pieces, codec, block_size=16)
        got = assemble(decode_delta(enc, meta, expected={k: tuple(v.shape) for k, v in pieces.items()}))["e"]
        assert torch.equal(got, want), codec


def test_pieces_of_an_embedding_keep_the_plain_mean_rule() -> None:
    keys = ["tok_embed.weight@rows:0:128", "tok_embed.weight@rows:128:256", "blocks.0.mlp.fc.weight", "lm_head.weight@rows:0:9"]
    assert plain_mean_tensors(keys, MergePolicy()) == keys[:2]


def test_partition_module_skips_frozen_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    model[0].bias.requires_grad_(False)
    names = [n for f in partition_module(model, 2) for n in f.names]
    assert sorted(names) == ["0.weight", "1.bias", "1.weight"]


@pytest.mark.parametrize(
    "count, every, expected",
    [
        # every == count: exactly one fragment per step, p = step mod count.
        (4, 4, {1: [1], 2: [2], 3: [3], 4: [0], 5: [1], 8: [0]}),
        # one fragment: fragment 0 every `every` steps.
        (1, 3, {1: [], 2: [], 3: [0], 6: [0], 7: []}),
        # every < count: several fragments per step.
        (4, 2, {1: [1, 3], 2: [0, 2], 3: [1, 3]}),
        # every > count: some steps send nothing.
        (2, 4, {1: [1], 2: [], 3: [], 4: [0], 5: [1]}),
    ],
)
def test_due_fragments_schedule(count: int, every: int, expected: dict[int, list[int]]) -> None:
    assert due_fragments(0, count, every) == []
    for step, due in expected.items():
        assert due_fragments(step, count, every) == due, step


def test_due_fragments_with_a_stride_spread_a_longer_period() -> None:
    # Every 8 steps with 4 fragments and stride 2: fragment p at steps 2p mod 8.
    assert {step: due_fragments(step, 4, 8, stride=2) for step in range(1, 9)} == {
        1: [], 2: [1], 3: [], 4: [2], 5: [], 6: [3], 7: [], 8: [0]}
    with pytest.raises(ValueError):
        due_fragments(1, 4, 8, stride=0)


def test_due_fragments_solved_for_p_agrees_with_trying_every_fragment() -> None:
    for count in (1, 3, 4, 24, 50):
        for every in (1, 2, 6, 8, 24, 96):
            for stride in (1, 2, 3, 4, 6):
                for step in range(1, 3 * every + 2):
                    tried = [p for p in range(count) if (step - p * stride) % every == 0]
                    assert due_fragments(step, count, every, stride) == tried, (step, count, every, stride)


def test_due_fragments_every_fragment_once_per_period() -> None:
    sent = [p for step in range(1, 25) for p in due_fragments(step, 24, 24)]
    assert sorted(sent) == list(range(24))
    with pytest.raises(ValueError):
        due_fragments(1, 0, 1)


# --- end to end: a model whose vocabulary matrices are split ------------------------------------------


def test_a_run_with_split_embeddings_trains_and_learners_agree_with_the_global_model() -> None:
    """A tiny GPT whose 2048-row embedding and lm_head are each ~half the model: at P = 4 both are cut
    into row pieces; the real learners and synchronizer train through piece keys end to end."""
    from support import tiny_config

    from ddiloco.inprocess import run_inprocess, sim_learner
    from ddiloco.platform.ledger import runs as runs_q
    from ddiloco.synchronizer.evaluation import evaluate_global, newest_params

    cfg = tiny_config(
        model={"kind": "gpt", "n_layer": 1, "d_model": 16, "n_head": 2, "seq_len": 32, "vocab_size": 2048},
        merge={"on_receipt": "overwrite"},
    )
    run = run_inprocess(cfg, total_tokens=2 * 4 * 32 * 40)
    layout = run.sync.layout
    split_keys = [pc.key for f in layout.fragments for pc in f.pieces if pc.rows is not None]
    assert {param_name(k) for k in split_keys} == {"tok_embed.weight", "lm_head.weight"}
    assert imbalance(layout.fragments) < 1.1
    with run.ctx.reading() as s:
        latest = runs_q.latest_version_numbers(s, run.ctx.run_id)
        specs = runs_q.fragment_specs(s, run.ctx.run_id)
    assert min(latest.values()) >= 3  # every fragment, split pieces included, was merged several times
    # The ledger records the layout by piece key and shape.
    assert {k for rows in specs.values() for k, _ in rows} == {pc.key for f in layout.fragments for pc in f.pieces}

    # The global model, reassembled from its pieces, trained (the embedding's rows too) ...
    initial = {n: p.detach() for n, p in build_model(run.ctx.cfg.model, seed=run.ctx.cfg.seed).named_parameters()}
    final = newest_params(run.ctx, run.sync.state)
    assert sorted(final) == sorted(initial)
    assert float((final["tok_embed.weight"] - initial["tok_embed.weight"]).abs().max()) > 1e-3
    loss0, _ = evaluate_global(run.ctx.cfg, initial)
    loss1, _ = evaluate_global(run.ctx.cfg, final)
    print(f"validation loss {loss0:.3f} -> {loss1:.3f}")
    assert loss1 < loss0 - 0.5, (loss0, loss1)
    # ... and a learner joining now receives every piece into its parameters: it holds the global model.
    late = sim_learner(run.ctx, "us-1")
    late.start(run.clock.t)
    for n, p in late.model.named_parameters():
        assert torch.equal(p.detach(), final[n]), n
    assert late.base == [latest[p] for p in range(len(layout.fragments))]


def test_a_tied_hugging_face_embedding_is_split_once_and_its_views_feed_both_uses() -> None:
    """A Llama with tied input/output embeddings lists the matrix once: it is cut into row pieces once,
    and a receipt written through a piece's view is what the lm_head computes with."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    frags = partition_module(model, 4)
    split_names = {pc.name for f in frags for pc in f.pieces if pc.rows is not None}
    assert split_names == {"model.embed_tokens.weight"} and "lm_head.weight" not in {n for f in frags for n in f.names}
    params = dict(model.named_parameters())
    views = {k: v for f in frags for k, v in fragment_views(params, f).items()}
    key = next(k for k in views if k.startswith("model.embed_tokens.weight@rows:"))
    start, end = parse_key(key)[1]
    with torch.no_grad():
        views[key].zero_()
    assert torch.count_nonzero(model.lm_head.weight[start:end]) == 0
    assert torch.count_nonzero(model.lm_head.weight) > 0
    rebuilt = assemble({k: v.clone() for k, v in views.items()})
    assert sorted(rebuilt) == sorted(params) and torch.equal(rebuilt["model.embed_tokens.weight"], model.lm_head.weight.detach())
