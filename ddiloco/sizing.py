"""What a run of a config will cost, from the config alone (``ddiloco config`` prints it): the model, a learner's
inner step, the state each of its ranks keeps, and what each learner sends. Nothing is read or allocated: the model
is built on the meta device."""

from __future__ import annotations

from dataclasses import dataclass

from ddiloco.platform.compression import codec_nbytes
from ddiloco.platform.config import RunConfig, tokens_per_step
from ddiloco.platform.models.cost import STATE_BYTES_PER_PARAM, ModelSize, meta_model, model_size, state_bytes_per_rank
from ddiloco.platform.redact import one_line
from ddiloco.platform.units import format_bytes, format_count, format_flops, plural


@dataclass(frozen=True)
class RunSize:
    """The figures of :func:`plan_lines`."""

    model: ModelSize
    tokens_per_step: int
    """Tokens (examples for a vision model) one inner step of a learner trains, over its ``nproc_per_node`` ranks."""
    steps_per_learner: int
    """Inner steps each learner takes over its share of the token budget (the length of its schedule)."""
    state_bytes: int
    """Float32 state one rank keeps under the configured parallelism."""
    sharded_state_bytes: int
    """The same sharded over the node's ranks (fsdp)."""
    fragments: int
    round_bytes: int
    """Encoded bytes of one send of every fragment with the configured codec (no blob headers)."""


def shard_ranks(cfg: RunConfig) -> int:
    """The ranks a parameter's rows are spread over on one node: hsdp's shard group, fsdp's node (more nodes shard
    further), none under ddp."""
    learners = cfg.learners
    if learners.parallelism == "ddp":
        return 1
    if learners.parallelism == "hsdp" and learners.shard_size:
        return learners.shard_size
    return learners.nproc_per_node


def run_size(cfg: RunConfig) -> RunSize:
    """Size a run of ``cfg`` (builds the model on the meta device; the config's model errors are raised)."""
    from ddiloco.learner_worker.schedule import schedule_steps
    from ddiloco.platform.fragments import partition_module

    net = meta_model(cfg.model)
    size = model_size(cfg.model, net)
    ranks = cfg.learners.nproc_per_node
    codec, block = cfg.compression.codec, cfg.compression.block_size
    parts = partition_module(net, cfg.fragments.count)
    return RunSize(
        model=size,
        tokens_per_step=tokens_per_step(cfg.model, cfg.learners.batch_size * cfg.inner.grad_accum_steps, ranks),
        steps_per_learner=schedule_steps(cfg, ranks),
        state_bytes=state_bytes_per_rank(size.params, cfg.learners.parallelism, shard_ranks(cfg)),
        sharded_state_bytes=state_bytes_per_rank(size.params, "fsdp", ranks),
        fragments=len(parts),
        round_bytes=sum(codec_nbytes(pc.numel, codec, block) for f in parts for pc in f.pieces),
    )


def plan_lines(cfg: RunConfig, size: RunSize) -> list[str]:
    """What ``ddiloco config`` says of a run's size, one line per subject."""
    m, learners = size.model, cfg.learners
    unit = "examples" if cfg.model.kind == "vision" else "tokens"
    flops = (f"{format_flops(m.flops_per_token)} per trained token (forward and backward at seq_len {cfg.model.seq_len})"
             if m.flops_per_token is not None else f"FLOPs not counted ({m.why_uncounted})")
    ranks, accum = learners.nproc_per_node, cfg.inner.grad_accum_steps
    shape = [plural(ranks, "rank"), plural(learners.batch_size, "example" if unit == "examples" else "sequence")]
    if accum > 1:
        shape.append(plural(accum, "micro-batch", "micro-batches"))
    if unit == "tokens":
        shape.append(plural(cfg.model.seq_len, "token"))
    state = (f"plan: each rank keeps {format_bytes(size.state_bytes)} of float32 state under {learners.parallelism} "
             f"over {plural(ranks, 'rank')} (weights, gradients, AdamW moments, outer snapshot: {STATE_BYTES_PER_PARAM} bytes a parameter"
             + (f", a 1/{shard_ranks(cfg)} row shard of them" if learners.parallelism != "ddp" and shard_ranks(cfg) > 1 else "")
             + "); activations come on top")
    if learners.parallelism == "ddp" and ranks > 1:
        state += f"; learners.parallelism fsdp would keep {format_bytes(size.sharded_state_bytes)}"
    elif learners.parallelism == "fsdp":
        state += "; a job of several nodes shards it over all their ranks"
    period = cfg.fragments.period
    per_unit = size.round_bytes / (period * size.tokens_per_step)
    return [
        f"plan: model {cfg.model.kind}, {format_count(m.params)} parameters ({format_count(m.embedding_params)} in "
        f"embedding tables), {flops}",
        f"plan: an inner step of a learner trains {size.tokens_per_step:,} {unit} ({' x '.join(shape)}); the token "
        f"budget is {size.steps_per_learner:,} steps a learner ({plural(learners.count, 'learner')})",
        state,
        f"plan: {size.fragments} fragments, each sent every {period} inner steps: {format_bytes(size.round_bytes)} per "
        f"learner every {period} steps with {cfg.compression.codec}, {per_unit:.3g} bytes per trained {unit[:-1]}"
        + (" (an adaptive learner sends less often or smaller on a slow link)" if cfg.fragments.adaptive else ""),
    ]


def plan_report(cfg: RunConfig, offline: bool = False) -> list[str]:
    """:func:`plan_lines`, or one line saying why the run was not sized (sizing never fails a config check)."""
    if offline and (cfg.model.hf_path or cfg.model.kind == "import"):
        return ["plan: not sized with --offline (building the model reads model.hf_path or imports model.import_path)"]
    try:
        size = run_size(cfg)
    except Exception as err:  # noqa: BLE001 - the checks that follow name a model that cannot be built
        return [f"plan: not sized: {one_line(err)}"]
    return plan_lines(cfg, size)
