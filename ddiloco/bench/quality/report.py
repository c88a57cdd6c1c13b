"""The quality benchmark's report: goals, notes, ablation lines, where the time went, the table and
the generated block of docs/quality.md — pure functions of the rows (no file, no clock)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ddiloco.bench.quality.plan import (
    ADAPTIVE_GOAL,
    ADAPTIVE_PAIRS,
    GOAL_COMM_RATIO,
    GOAL_PREFIXES,
    GOALS_VS_DILOCO,
    GPU_GOALS,
    GPU_MODEL,
    GPU_REGIMES,
    GPU_SCALES,
    MODELS,
    ROBUST_GATE,
    ROBUST_PUBLISH_SHARE,
    Scale,
    is_gpu,
    robust_gate_pairs,
    row_outages,
    seeded,
)
from ddiloco.bench.quality.run import Row

BEGIN, END = "<!-- quality:begin (written by `ddiloco bench quality --publish`) -->", "<!-- quality:end -->"
GPU_BEGIN = "<!-- quality-gpu:begin (written by `ddiloco bench quality --scale gpu --publish`) -->"
GPU_END = "<!-- quality-gpu:end -->"


def find(rows: Sequence[Row], model: str, regime: str) -> Row | None:
    return next((r for r in rows if r.model == model and r.regime == regime), None)


def goals(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The issue's goals (:mod:`plan`'s thresholds) as PASS/FAIL lines, with their figures."""
    out: list[dict[str, Any]] = []
    models = [m for m in MODELS if any(r.model == m for r in rows)]
    for m in models:
        for prefix, ref_name in GOAL_PREFIXES:
            ref = find(rows, m, ref_name)
            if ref is None:
                continue
            for regime, tol in GOALS_VS_DILOCO:
                r = find(rows, m, prefix + regime)
                if r is None:
                    continue
                gap = r.val_loss / ref.val_loss - 1
                out.append({"goal": f"{m}: {prefix}{regime} within {100 * tol:.0f}% of {ref_name}'s val loss", "pass": gap <= tol,
                            "figure": f"{r.val_loss:.4f} vs {ref.val_loss:.4f} ({100 * gap:+.2f}%)", "value": gap})
        ref = find(rows, m, "diloco")
        if ref is None:
            continue
        dp = find(rows, m, "data_parallel")
        if dp is not None:
            ratio = ref.val_loss / dp.val_loss
            out.append({"goal": f"{m}: diloco at or below data-parallel's val loss (ratio diloco/dp <= 1)", "pass": ratio <= 1.0,
                        "figure": f"diloco {ref.val_loss:.4f} / dp {dp.val_loss:.4f} = {ratio:.4f}", "value": ratio})
            dec = find(rows, m, "decoupled")
            if dec is not None:
                ratio = dec.val_loss / dp.val_loss
                out.append({"goal": f"{m}: decoupled at or below data-parallel's val loss (ratio decoupled/dp <= 1)",
                            "pass": ratio <= 1.0, "figure": f"decoupled {dec.val_loss:.4f} / dp {dp.val_loss:.4f} = {ratio:.4f}",
                            "value": ratio})
    for m in models:
        dp = find(rows, m, "data_parallel")
        if dp is None:
            continue
        for int4 in [r for r in rows if r.model == m and r.regime in ("ablation_int4", "ablation_int4_h32")]:
            ratio = dp.bytes_per_token / int4.bytes_per_token
            payload = dp.payload_bytes_per_token / int4.payload_bytes_per_token
            H = int4.knobs["every"]
            cost = ""
            ref = find(rows, m, "diloco")
            if ref is not None:
                cost = f"; val loss {int4.val_loss:.4f}, {100 * (int4.val_loss / ref.val_loss - 1):+.2f}% vs diloco"
            out.append({"goal": f"{m}: bytes/token >= {GOAL_COMM_RATIO:.0f}x below data-parallel with int4 outer gradients "
                                f"(H = {H})",
                        "pass": ratio >= GOAL_COMM_RATIO,
                        "figure": f"{dp.bytes_per_token:.1f} / {int4.bytes_per_token:.3f} B/token = {ratio:.0f}x "
                                  f"(payload only, without blob headers: {payload:.0f}x{cost})",
                        "value": ratio})
    out += robust_goals(rows)
    out += adaptive_goals(rows)
    return out


def gpu_goals(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Issue #26's goals (``GPU_GOALS``): each row's final validation loss over its reference row's, at equal tokens."""
    out = []
    for regime, ref_name, tol in GPU_GOALS:
        r, ref = find(rows, GPU_MODEL, regime), find(rows, GPU_MODEL, ref_name)
        if r is None or ref is None:
            continue
        ratio = r.val_loss / ref.val_loss
        out.append({"goal": f"{regime} / {ref_name} final validation loss <= {1 + tol:.2f} at equal tokens", "pass": ratio <= 1 + tol,
                    "figure": f"{r.val_loss:.4f} / {ref.val_loss:.4f} = {ratio:.4f}", "value": ratio})
    return out


def adaptive_goals(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Issue #18: an adaptive row at most ADAPTIVE_GOAL above its fixed row's validation loss, and below it
    where the fixed learners' upload queue grew (an increment waited longer than a send period)."""
    out = []
    for m in MODELS:
        for adaptive, fixed in ADAPTIVE_PAIRS:
            a, f = find(rows, m, adaptive), find(rows, m, fixed)
            if a is None or f is None:
                continue
            gap = a.val_loss / f.val_loss - 1
            out.append({"goal": f"{m}: {adaptive} within {100 * ADAPTIVE_GOAL:.1f}% of {fixed}'s val loss", "pass": gap <= ADAPTIVE_GOAL,
                        "figure": f"{a.val_loss:.4f} vs {f.val_loss:.4f} ({100 * gap:+.2f}%)", "value": gap})
            period = f.knobs.get("every", 0)
            waited = max((x["max_oldest_unsent_s"] for x in (f.links or {}).values()), default=0.0)
            if waited > period:
                out.append({"goal": f"{m}: {adaptive} below {fixed}'s val loss (its upload queue grew: an increment waited "
                                    f"{waited:.0f} s, more than a send period of {period} s)",
                            "pass": gap < 0, "figure": f"{a.val_loss:.4f} vs {f.val_loss:.4f} ({100 * gap:+.2f}%)", "value": gap})
    return out


def robust_goals(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Issue #16's gate per attack row: within ROBUST_GATE of the same options without the hostile
    learner, and every fragment still publishing (:data:`ROBUST_PUBLISH_SHARE`)."""
    out = []
    for m in MODELS:
        for attacked, honest in robust_gate_pairs([r.regime for r in rows if r.model == m]):
            a, h = find(rows, m, attacked), find(rows, m, honest)
            assert a is not None and h is not None
            gap = a.val_loss / h.val_loss - 1
            publishing = None
            if a.fewest_versions is not None and h.fewest_versions is not None:
                publishing = a.fewest_versions >= ROBUST_PUBLISH_SHARE * h.fewest_versions
            merges = "" if publishing is None else f"; fewest merges of a fragment {a.fewest_versions} vs {h.fewest_versions}"
            out.append({"goal": f"{m}: {attacked} within {100 * ROBUST_GATE:.0f}% of {honest}'s val loss (one hostile learner "
                                f"vs none, same options), every fragment publishing",
                        "pass": gap <= ROBUST_GATE and publishing is not False,
                        "figure": f"{a.val_loss:.4f} vs {h.val_loss:.4f} ({100 * gap:+.2f}%){merges}", "value": gap})
    return out


def _loss_at(row: Row, tokens: float) -> float | None:
    """Validation loss of the evaluation nearest ``tokens`` (the curves share their token grid)."""
    pts = [c for c in row.curve if c[2] is not None]
    if not pts:
        return None
    return min(pts, key=lambda c: abs(c[0] - tokens))[2]


def _late_mean(row: Row | None, share: float = 0.25) -> float | None:
    """Mean validation loss of the evaluations in the last ``share`` of the row's tokens."""
    if row is None:
        return None
    pts = [c[2] for c in row.curve if c[2] is not None and c[0] >= (1 - share) * row.tokens - 1]
    return sum(pts) / len(pts) if pts else None


def notes(rows: Sequence[Row]) -> list[str]:
    """Figures that explain the PASS/FAIL lines: the DP ratio along training, seed noise, wall-clock saved."""
    out = []
    for m in MODELS:
        dp, ref, dec = find(rows, m, "data_parallel"), find(rows, m, "diloco"), find(rows, m, "decoupled")
        if dp is not None and ref is not None:
            parts = []
            for frac in (0.25, 0.5, 0.75, 1.0):
                a, b = _loss_at(ref, frac * ref.tokens), _loss_at(dp, frac * ref.tokens)
                if a is not None and b is not None:
                    parts.append(f"{frac:.0%}: {a / b:.3f}")
            out.append(f"{m}: diloco/data-parallel val-loss ratio along training (share of tokens: ratio) " + ", ".join(parts))
        if ref is not None:
            gaps = []
            for regime in ("decoupled", "decoupled_stragglers", "decoupled_failures"):
                r = find(rows, m, regime)
                a, b = _late_mean(r), _late_mean(ref)
                if a is not None and b is not None:
                    gaps.append(f"{regime} {100 * (a / b - 1):+.2f}%")
            if gaps:
                out.append(f"{m}: gap to diloco averaged over the evaluations of the last quarter of training (less sensitive to "
                           f"where an oscillating curve ends): " + ", ".join(gaps))
        s0, s1, d1 = find(rows, m, "diloco"), find(rows, m, "diloco_seed1"), find(rows, m, "decoupled_seed1")
        if s0 is not None and s1 is not None:
            out.append(f"{m}: seed noise: diloco seed 1 vs seed 0 {100 * (s1.val_loss / s0.val_loss - 1):+.2f}%")
            if d1 is not None and dec is not None:
                out.append(f"{m}: decoupled vs diloco: {100 * (dec.val_loss / s0.val_loss - 1):+.2f}% at seed 0, "
                           f"{100 * (d1.val_loss / s1.val_loss - 1):+.2f}% at seed 1")
        for kind in ("stragglers", "failures"):
            d, sy = find(rows, m, f"decoupled_{kind}"), find(rows, m, f"diloco_{kind}")
            if d is not None and sy is not None:
                out.append(f"{m}: with {kind}, equal tokens took {d.wall_clock_s:.0f} simulated s decoupled vs {sy.wall_clock_s:.0f} s "
                           f"synchronous (goodput {d.goodput:.3f} vs {sy.goodput:.3f}; val loss {d.val_loss:.4f} vs {sy.val_loss:.4f})")
    return out + seed_notes(rows)


def seed_notes(rows: Sequence[Row]) -> list[str]:
    """Per row trained at another seed as well (``<row>_seed<N>``): its ratio to data-parallel at each seed, each
    against the same seed's data-parallel row, so that the spread chance makes sits beside the plan's figure."""
    out = []
    for r in rows:
        n, base = row_seed(r), find(rows, r.model, r.base or "")
        if not n or r.group != "noise" or base is None or row_seed(base):
            continue
        dp0, dpn = find(rows, r.model, "data_parallel"), find(rows, r.model, seeded("data_parallel", n))
        if dp0 is None or dpn is None:
            continue
        if base is dp0:
            out.append(f"{r.model}: data_parallel at seed {n} vs seed 0: {100 * (r.val_loss / base.val_loss - 1):+.2f}%")
        else:
            out.append(f"{r.model}: {base.regime} ÷ data-parallel of the same seed: {base.val_loss / dp0.val_loss:.4f} at seed 0, "
                       f"{r.val_loss / dpn.val_loss:.4f} at seed {n}")
    return out


def ablation_lines(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Each ablation, sweep, reference and noise row against the row it changes one thing of."""
    out = []
    for r in rows:
        if r.group not in ("ablation", "sweep", "reference", "noise") or r.base is None:
            continue
        base = find(rows, r.model, r.base)
        if base is None:
            continue
        d = r.val_loss / base.val_loss - 1
        out.append({"model": r.model, "row": r.regime, "knob": r.knob, "base": r.base, "val_loss": r.val_loss,
                    "base_val_loss": base.val_loss, "delta": d, "lower": "tie" if abs(d) < 1e-5 else (r.regime if d < 0 else r.base)})
    return out


# --- where the time goes -------------------------------------------------------------------------

_SYNC_MERGE = ("sync.fetch", "sync.merge", "sync.publish")
BREAKDOWN: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("train_step (forward, backward, AdamW)", ("learner.compute",), ()),
    ("learner: send (outer gradient staged for upload)", ("learner.send",), ()),
    ("learner: upload (encode, blob, ledger row)", ("learner.upload",), ()),
    ("learner: poll for new versions (ledger + blob reads)", ("learner.poll_versions",), ()),
    ("learner: apply received versions", ("learner.apply",), ()),
    ("learner: heartbeats", ("learner.heartbeat",), ()),
    ("synchronizer: merges (read, validate, merge, outer step, publish)", _SYNC_MERGE, ()),
    ("synchronizer: poll overhead (lease, statuses, pending queries)", ("sync.poll_once",), (*_SYNC_MERGE, "sync.gc")),
    ("synchronizer: blob garbage collection", ("sync.gc",), ()),
    ("evaluation of the global model", ("eval",), ()),
)
"""(part, profile keys it adds, nested keys it takes out) for the time table; a part none of whose
spans ran is left out, and what no part holds is "other"."""


def time_breakdown(rows: Sequence[Row]) -> dict[str, Any]:
    """Where the benchmark's real seconds went, over the in-process rows."""
    p: dict[str, float] = {}
    real = 0.0
    for r in rows:
        if r.regime.startswith("data_parallel"):
            continue
        real += r.real_s
        for k, v in r.profile.items():
            p[k] = p.get(k, 0.0) + v
    if not real:
        return {}

    def g(k: str) -> float:
        return p.get(k, 0.0)

    steps = int(g("learner.compute.calls"))
    parts = {
        part: sum(g(k) for k in plus) - sum(g(k) for k in minus) for part, plus, minus in BREAKDOWN if any(k in p for k in plus)
    }
    parts["other (event loop, drain, run and learner setup, accounting)"] = real - sum(parts.values())
    return {
        "real_s": round(real, 1),
        "learner_steps": steps,
        "ms_per_learner_step": round(1000 * real / max(1, steps), 2),
        "share": {k: round(v / real, 4) for k, v in parts.items()},
        "seconds": {k: round(v, 1) for k, v in parts.items()},
        "sql_statements": int(g("sql.statements")),
        "sql_statements_per_learner_step": round(g("sql.statements") / max(1, steps), 2),
        "sql_s": round(g("sql.s"), 1),
        "sql_share": round(g("sql.s") / real, 4),
        "sync_polls": int(g("sync.poll_once.calls")),
    }


# --- the results file ----------------------------------------------------------------------------


def row_json(r: Row) -> dict[str, Any]:
    d = {**asdict(r), "nats_per_byte": r.nats_per_byte, "train_tokens_per_s": r.train_tokens_per_s}
    # The keys first.
    head = ["model", "regime", "tokens", "val_loss", "nats_per_byte", "val_accuracy", "bytes_per_token", "goodput"]
    return {**{k: d[k] for k in head}, **{k: v for k, v in d.items() if k not in head}}


def rows_from_json(data: dict[str, Any]) -> list[Row]:
    names = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in r.items() if k in names}) for r in data["rows"]]


def results(rows: Sequence[Row], *, scale: Scale, jobs: int, date: str, total_real_s: float, cpu_s: float,
            provenance: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The results file's content (``provenance``: commit, dirty and machine, as the other benchmarks write them;
    ``extra``: what else the plan records, such as the GPU plan's corpus)."""
    return {
        "benchmark": "quality",
        "date": date,
        **provenance,
        "scale": asdict(scale),
        "jobs": jobs,
        "total_real_s": round(total_real_s, 1),
        **(extra or {}),
        "rows": [row_json(r) for r in rows],
        "goals": gpu_goals(rows) if is_gpu(scale) else goals(rows),
        "ablations": ablation_lines(rows),
        "notes": notes(rows),
        "cpu_s": cpu_s,
        "time_breakdown": time_breakdown(rows),
        "outages": [asdict(o) for o in row_outages([f"dc-{i}" for i in range(scale.learners)], scale)],
    }


def rescored(data: dict[str, Any]) -> dict[str, Any]:
    """A results file with its goals, notes and ablation lines worked out again from its rows (and its targeted runs')."""
    rows = rows_from_json(data)
    targeted = [{**t, "goals": goals(rows_from_json(t)), "ablations": ablation_lines(rows_from_json(t))}
                for t in data.get("targeted", [])]
    gpu = data["scale"]["name"] in GPU_SCALES
    return {**data, "goals": gpu_goals(rows) if gpu else goals(rows), "ablations": ablation_lines(rows), "notes": notes(rows),
            **({"targeted": targeted} if targeted else {})}


TARGETED_KEYS = ("date", "commit", "dirty", "machine", "jobs", "total_real_s", "cpu_s", "scale", "rows", "goals", "ablations")


def with_targeted(published: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """``published`` with ``result`` (a run of a few rows) added as a targeted run, its rows apart
    from the full run's: another machine or interpreter reads another corpus, so they are compared
    only with each other. A targeted run of the same rows is replaced; the full run's rows are kept."""
    entry = {k: result[k] for k in TARGETED_KEYS if k in result}
    names = {(r["model"], r["regime"]) for r in entry["rows"]}
    kept = [t for t in published.get("targeted", []) if {(r["model"], r["regime"]) for r in t["rows"]} != names]
    return {**published, "targeted": [*kept, entry]}


# --- text ----------------------------------------------------------------------------------------


def format_table(rows: Sequence[Row], markdown: bool = False) -> str:
    cols = ["model", "regime", "tokens", "val loss", "nats/byte", "vs diloco", "val acc", "bytes/token", "goodput",
            "wall-clock (sim s)", "merges", "learners/merge"]
    lines = []
    for r in rows:
        ref = find(rows, r.model, "diloco")
        vs = f"{100 * (r.val_loss / ref.val_loss - 1):+.2f}%" if ref is not None else ""
        npb = "" if r.nats_per_byte is None else f"{r.nats_per_byte:.4f}"
        lines.append([r.model, r.regime, f"{r.tokens:,}", f"{r.val_loss:.4f}", npb, vs,
                      "" if r.val_accuracy is None else f"{r.val_accuracy:.3f}", f"{r.bytes_per_token:.3f}", f"{r.goodput:.3f}",
                      f"{r.wall_clock_s:.0f}", str(r.merges), f"{r.mean_learners_per_merge:.2f}"])
    if markdown:
        out = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" if i < 2 else "---:" for i in range(len(cols))) + " |"]
        out += ["| " + " | ".join(x) + " |" for x in lines]
        return "\n".join(out)
    widths = [max(len(c), *(len(x[i]) for x in lines)) for i, c in enumerate(cols)]

    def fmt(xs: list[str]) -> str:
        return "  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(xs, widths, strict=True)))

    return "\n".join([fmt(cols)] + [fmt(x) for x in lines])


def summary_lines(result: dict[str, Any], rows: Sequence[Row]) -> list[str]:
    """What the command prints: the table, PASS/FAIL lines, notes, ablations and where the time went."""
    lines = ["", format_table(rows), ""]
    lines += [f"{'PASS' if g['pass'] else 'FAIL'}  {g['goal']}: {g['figure']}" for g in result["goals"]]
    lines += [f"NOTE  {n}" for n in result["notes"]]
    lines += [f"{a['row'].split('_')[0].upper():9s} {a['model']} {a['knob']}: {a['val_loss']:.4f} vs {a['base_val_loss']:.4f} "
              f"({100 * a['delta']:+.2f}%), lower loss: {a['lower']}" for a in result["ablations"]]
    tb = result["time_breakdown"]
    if tb:
        lines += ["", f"time: {tb['real_s']} s in-process, {tb['ms_per_learner_step']} ms per learner step, "
                      f"{tb['sql_statements_per_learner_step']} SQL statements per learner step ({100 * tb['sql_share']:.0f}% of the time)"]
        lines += [f"  {100 * v:5.1f}%  {k}" for k, v in sorted(tb["share"].items(), key=lambda kv: -kv[1])]
    lines += ["", f"total {result['total_real_s']:.0f} s"]
    return lines


def docs_block(result: dict[str, Any], rows: Sequence[Row]) -> str:
    """The generated block of docs/quality.md, markers included."""
    m = result["machine"]
    lines = [
        BEGIN,
        "",
        (
            f"Run of {result['date'][:10]} on commit `{(result.get('commit') or 'unknown')[:10]}`"
            f"{' (with uncommitted changes)' if result.get('dirty') else ''}, {m['cores']} cores "
            f"(load average {m['load_avg_1m']} at the end), torch {m['torch']}, {result['jobs']} worker process(es), "
            f"{result['total_real_s']:.0f} s in all ({result.get('cpu_s', 0):.0f} CPU seconds). "
            f"Scale: {result['scale']['learners']} learners x {result['scale']['steps']} steps at full speed; "
            "`vs diloco` is the relative difference in validation loss; `nats/byte` is validation loss per byte of text "
            "(per token over the UTF-8 bytes a token spells), which compares the byte-level and the BPE rows."
        ),
        "",
        format_table(rows, markdown=True),
        "",
        "Goals:",
        "",
    ]
    lines += goal_lines(result["goals"])
    lines += ["", "Notes:", ""] + [f"- {n}" for n in result.get("notes", [])]
    lines += ["", "Ablations, sweep, references and seed noise (each row changes one thing of its base row):", ""]
    lines += ablation_table(result["ablations"])
    tb = result.get("time_breakdown") or {}
    if tb:
        intro = (
            f"Where the time goes (in-process rows: {tb['real_s']} s, {tb['learner_steps']} learner steps, "
            f"{tb['ms_per_learner_step']} ms per learner step; {tb['sql_statements_per_learner_step']} SQL statements "
            f"per learner step taking {100 * tb['sql_share']:.0f}% of the time):"
        )
        lines += ["", intro, "", "| part | share | seconds |", "| --- | ---: | ---: |"]
        lines += [f"| {k} | {100 * v:.1f}% | {tb['seconds'][k]:.1f} |" for k, v in sorted(tb["share"].items(), key=lambda kv: -kv[1])]
    for t in result.get("targeted", []):
        lines += ["", *targeted_block(t)]
    lines += ["", END]
    return "\n".join(lines)


def targeted_block(t: dict[str, Any]) -> list[str]:
    """A targeted run's part of the docs block: where it ran, its table, goals and ablation lines."""
    m, rows = t["machine"], rows_from_json(t)
    names = ", ".join(f"`{r.regime}`" for r in rows)
    lines = [
        f"Targeted run of {t['date'][:10]} on commit `{(t.get('commit') or 'unknown')[:10]}`"
        f"{' (with uncommitted changes)' if t.get('dirty') else ''}, {m['cores']} cores (load average {m['load_avg_1m']} at the "
        f"end), Python {m['python']}, torch {m['torch']}, {t['jobs']} worker process(es), {t['total_real_s']:.0f} s: {names} "
        f"({t['scale']['learners']} learners x {t['scale']['steps']} steps). Its corpus is that interpreter's standard library, "
        "so compare these rows with each other, not with the table above.",
        "",
        format_table(rows, markdown=True),
        "",
    ]
    return [*lines, *goal_lines(t["goals"]), "", *ablation_table(t["ablations"])]


def goal_lines(goal_list: Sequence[dict[str, Any]]) -> list[str]:
    return [f"- **{'PASS' if g['pass'] else 'FAIL'}** {g['goal']}: {g['figure']}" for g in goal_list]


def ablation_table(ablations: Sequence[dict[str, Any]]) -> list[str]:
    """The markdown table of ablation lines, header included."""
    lines = ["| model | row | what changes | val loss | base row | base val loss | change | lower loss |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | --- |"]
    return lines + [f"| {a['model']} | {a['row']} | {a['knob']} | {a['val_loss']:.4f} | {a['base']} | {a['base_val_loss']:.4f} | "
                     f"{100 * a['delta']:+.2f}% | {a['lower']} |" for a in ablations]


def with_docs_block(page: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """``page`` with its generated block (between ``begin`` and ``end``) replaced by ``block`` (appended if the page has none)."""
    if begin in page and end in page:
        head, rest = page.split(begin, 1)
        _, tail = rest.split(end, 1)
        return head + block + tail
    return page.rstrip() + "\n\n" + block + "\n"


# --- the GPU plan ---------------------------------------------------------------------------------


def row_seed(row: Row) -> int:
    """The seed a row was trained at (rows written before seeds were recorded: the plans' 0)."""
    return int(row.knobs.get("seed", 0) or 0)


def gpu_table(rows: Sequence[Row]) -> list[str]:
    """The GPU plan's markdown table: losses per token and per byte, their ratios to the references of the same seed,
    bytes per token, and the wall-clock of each regime (real seconds, training throughput, simulated seconds)."""
    cols = ["regime", "tokens", "val loss (nats/token)", "nats/byte", "÷ data-parallel", "÷ diloco", "bytes/token", "goodput",
            "wall-clock (real s)", "train tokens/s", "simulated s", "merges", "device"]
    align = ["---" if i in (0, len(cols) - 1) else "---:" for i in range(len(cols))]
    out = ["| " + " | ".join(cols) + " |", "| " + " | ".join(align) + " |"]
    for r in rows:
        dp, ref = (find(rows, GPU_MODEL, seeded(name, row_seed(r))) for name in ("data_parallel", "diloco"))
        tps = r.train_tokens_per_s
        out.append("| " + " | ".join([
            r.regime, f"{r.tokens:,}", f"{r.val_loss:.4f}", "" if r.nats_per_byte is None else f"{r.nats_per_byte:.4f}",
            "" if dp is None else f"{r.val_loss / dp.val_loss:.4f}", "" if ref is None else f"{r.val_loss / ref.val_loss:.4f}",
            f"{r.bytes_per_token:.3f}", f"{r.goodput:.3f}", f"{r.real_s:.0f}", "" if tps is None else f"{tps:,.0f}",
            f"{r.wall_clock_s:.0f}", str(r.merges), r.device or ""]) + " |")
    return out


def gpu_docs_block(result: dict[str, Any], rows: Sequence[Row], plot_stem: str) -> str:
    """The GPU plan's generated block of docs/quality.md, markers included: where and on what it ran, the table, the
    goals, the rows not run yet and the plot of every regime's curve."""
    m, c = result["machine"], (rows[0].corpus if rows else None) or {}
    codes = sorted({(r.code or "unknown")[:10] for r in rows})
    per_regime = rows[0].tokens if rows else 0
    epochs = f", {per_regime / c['train_tokens']:.2f} epochs of it per regime" if c.get("train_tokens") and per_regime else ""
    lines = [
        GPU_BEGIN,
        "",
        f"Rows written {result['date'][:10]} at code `{', '.join(codes)}` (sha256 of `ddiloco/**/*.py`; git commit "
        f"`{(result.get('commit') or 'unknown')[:10]}`{' with uncommitted changes' if result.get('dirty') else ''}) on "
        f"{m.get('gpu') or 'no GPU'}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}. Scale "
        f"`{result['scale']['name']}`: {result['scale']['learners']} learners x {result['scale']['steps']} steps; "
        f"{sum(r.real_s for r in rows):.0f} s of training rows{_prepare_note(result)}.",
        "",
        f"Corpus: the Python sources of {c.get('packages', '?')} installed packages (Python {c.get('python', '?')}), "
        f"{c.get('train_bytes', 0) / 1e6:.1f} MB training and {c.get('val_bytes', 0) / 1e6:.1f} MB validation (whole packages), "
        f"{c.get('train_tokens', 0):,} / {c.get('val_tokens', 0):,} tokens of a {c.get('vocab_size', '?')}-token BPE trained "
        f"here{epochs}; corpus digest `{str(c.get('corpus_sha256'))[:16]}`, tokenizer `{str(c.get('tokenizer_sha256'))[:16]}` "
        "(the package list and every shard's sha256 are in the results file).",
        "",
        *gpu_table(rows),
        "",
        "Goals (measured, not tuned to pass):",
        "",
        *goal_lines(result["goals"]),
    ]
    missing = [g for g in GPU_REGIMES if find(rows, GPU_MODEL, g) is None]
    if missing:
        lines += ["", f"Not run yet at this code: {', '.join(f'`{g}`' for g in missing)} (`--only {','.join(missing)}`)."]
    if result.get("notes"):
        lines += ["", "Notes:", "", *[f"- {n}" for n in result["notes"]]]
    if rows:
        lines += ["", f"![validation loss of every regime vs tokens and simulated wall-clock]({plot_stem}-{GPU_MODEL}.png)"]
    return "\n".join([*lines, "", GPU_END])


def _prepare_note(result: dict[str, Any]) -> str:
    s = result.get("prepare_s")
    if s is None:
        return ""
    what = "preparing the corpus (listing, BPE, token shards)" if result.get("prepared") else "checking the prepared corpus"
    return f"; {what} took {s:.0f} s in the last command"
