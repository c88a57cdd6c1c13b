"""Fragment balance: max / mean fragment bytes at P = 24, whole tensors vs row pieces.

Shapes come from each config's arithmetic (no model is built), so a 1B or 8B Llama costs nothing:

    llama: embed (V, d); per layer: 2 RMSNorm (d), q (h·hd, d), k and v (kv·hd, d), o (d, h·hd),
           gate and up (I, d), down (d, I); final norm (d); lm_head (V, d) unless tied
    gpt:   the platform's byte-level GPT (ddiloco/platform/models): token and position embeddings,
           LayerNorms with biases, fused qkv, 4·d MLP, untied lm_head

"before" packs whole tensors (``partition(..., split_above=None)``), "after" is the platform's rule
(``fragments.SPLIT_ABOVE``). float32 parameters, as the learners hold them. Pure arithmetic: the
figures do not depend on the machine.

    python benchmarks/fragment_balance.py [--quick] [--count 24]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, header, verdict, write_results

from ddiloco.platform.fragments import SPLIT_ABOVE, imbalance, partition

NAME = "fragment_balance"
GOAL = 1.10
"""Max / mean fragment bytes after splitting, for the Llama configs at P = 24."""

Shapes = list[tuple[str, tuple[int, ...], int]]


def llama_shapes(vocab: int, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, tied: bool) -> Shapes:
    hd = hidden // heads
    out: Shapes = [("model.embed_tokens.weight", (vocab, hidden), 4)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,), 4),
            (p + "self_attn.q_proj.weight", (heads * hd, hidden), 4),
            (p + "self_attn.k_proj.weight", (kv_heads * hd, hidden), 4),
            (p + "self_attn.v_proj.weight", (kv_heads * hd, hidden), 4),
            (p + "self_attn.o_proj.weight", (hidden, heads * hd), 4),
            (p + "post_attention_layernorm.weight", (hidden,), 4),
            (p + "mlp.gate_proj.weight", (intermediate, hidden), 4),
            (p + "mlp.up_proj.weight", (intermediate, hidden), 4),
            (p + "mlp.down_proj.weight", (hidden, intermediate), 4),
        ]
    out.append(("model.norm.weight", (hidden,), 4))
    if not tied:
        out.append(("lm_head.weight", (vocab, hidden), 4))
    return out


def gpt_shapes(vocab: int, d: int, layers: int, seq_len: int) -> Shapes:
    out: Shapes = [("tok_embed.weight", (vocab, d), 4), ("pos_embed.weight", (seq_len, d), 4)]
    for i in range(layers):
        p = f"blocks.{i}."
        out += [
            (p + "ln1.weight", (d,), 4), (p + "ln1.bias", (d,), 4),
            (p + "attn.qkv.weight", (3 * d, d), 4), (p + "attn.qkv.bias", (3 * d,), 4),
            (p + "attn.proj.weight", (d, d), 4), (p + "attn.proj.bias", (d,), 4),
            (p + "ln2.weight", (d,), 4), (p + "ln2.bias", (d,), 4),
            (p + "mlp.fc.weight", (4 * d, d), 4), (p + "mlp.fc.bias", (4 * d,), 4),
            (p + "mlp.proj.weight", (d, 4 * d), 4), (p + "mlp.proj.bias", (d,), 4),
        ]
    return out + [("ln_f.weight", (d,), 4), ("ln_f.bias", (d,), 4), ("lm_head.weight", (vocab, d), 4)]


CONFIGS: dict[str, tuple[str, Shapes]] = {
    "llama-1b": (
        "Llama-3.2-1B-like: vocab 128,256, hidden 2048, 16 layers, intermediate 8192, 32/8 heads, tied embeddings",
        llama_shapes(128_256, 2048, 16, 8192, 32, 8, tied=True),
    ),
    "llama-1b-untied": (
        "the same with a separate lm_head",
        llama_shapes(128_256, 2048, 16, 8192, 32, 8, tied=False),
    ),
    "llama-100m": (
        "vocab 128,256, hidden 512, 8 layers, intermediate 2048, 8/8 heads, tied embeddings",
        llama_shapes(128_256, 512, 8, 2048, 8, 8, tied=True),
    ),
    "llama-8b": (
        "Llama-3-8B-like: vocab 128,256, hidden 4096, 32 layers, intermediate 14336, 32/8 heads, untied",
        llama_shapes(128_256, 4096, 32, 14336, 32, 8, tied=False),
    ),
    "gpt-default": (
        "the platform's default byte-level GPT (vocab 256, d 128, 2 layers, seq 128)",
        gpt_shapes(256, 128, 2, 128),
    ),
}


def measure(shapes: Shapes, count: int) -> dict:
    before = partition(shapes, count, split_above=None)
    after = partition(shapes, count)
    mean = sum(f.nbytes for f in after) / count
    return {
        "params": sum(f.numel for f in after),
        "tensors": len(shapes),
        "pieces": sum(len(f.pieces) for f in after),
        "split_tensors": len({pc.name for f in after for pc in f.pieces if pc.rows is not None}),
        "mean_fragment_mb": mean / 1e6,
        "before": {"max_fragment_mb": max(f.nbytes for f in before) / 1e6, "max_over_mean": imbalance(before)},
        "after": {"max_fragment_mb": max(f.nbytes for f in after) / 1e6, "max_over_mean": imbalance(after)},
    }


def main() -> None:
    ap = base_parser(__doc__)
    ap.add_argument("--count", type=int, default=24, help="P, the number of fragments (default 24)")
    args = ap.parse_args()
    rows = {}
    print(f"P = {args.count}, split above {SPLIT_ABOVE} x the mean fragment; float32 bytes")
    print(f"{'config':<16} {'params':>8} {'tensors':>7} {'pieces':>6} {'mean MB':>8} {'before max/mean':>15} {'after max/mean':>14}")
    for name, (what, shapes) in CONFIGS.items():
        r = measure(shapes, args.count)
        rows[name] = {"config": what, **r}
        print(
            f"{name:<16} {r['params'] / 1e6:>7.1f}M {r['tensors']:>7} {r['pieces']:>6} {r['mean_fragment_mb']:>8.1f} "
            f"{r['before']['max_over_mean']:>15.2f} {r['after']['max_over_mean']:>14.3f}"
        )
    llama_ok = all(rows[n]["after"]["max_over_mean"] <= GOAL for n in rows if n.startswith("llama"))
    print(f"Llama configs at P = {args.count}: after max/mean <= {GOAL}: {verdict(llama_ok)}")
    results = {**header(NAME, args), "count": args.count, "split_above": SPLIT_ABOVE, "goal_max_over_mean": GOAL,
               "pass": llama_ok, "configs": rows}
    write_results(NAME, results, args.json)


if __name__ == "__main__":
    main()
