"""The ``ddiloco`` command: one entry point for every process and tool."""

from __future__ import annotations

import json
import logging
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from ddiloco.bench.command import bench_app
from ddiloco.platform.config import ConfigError, RunConfig, load_config
from ddiloco.platform.redact import RedactingFilter, redact_url
from ddiloco.simulator.command import simulate_command
from ddiloco.ui.command import ui_command

if TYPE_CHECKING:  # the runtime stays unimported until a command needs it (bad input is refused in a second)
    from ddiloco.platform.runtime import RunContext

app = typer.Typer(help="Decoupled DiLoCo pre-training: learners, synchronizer, demo and tools.", no_args_is_help=True)
ledger_app = typer.Typer(help="The SQL ledger.", no_args_is_help=True)
store_app = typer.Typer(help="The fragment store.", no_args_is_help=True)
app.add_typer(ledger_app, name="ledger")
app.add_typer(store_app, name="store")
app.add_typer(bench_app, name="bench")
data_app = typer.Typer(help="Training data: tokenize a corpus into shards.", no_args_is_help=True)
app.add_typer(data_app, name="data")
console = Console()
# Errors stay one line however narrow the terminal (or log collector) is.
err_console = Console(stderr=True, soft_wrap=True)

ConfigOpt = typer.Option(None, "--config", "-c", help="Run config (YAML or TOML); env DDILOCO_* overrides it.")
LedgerOpt = typer.Option(None, "--ledger", help="Ledger URL; defaults to the config's ledger.url.")


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())


def _config(path: Path | None) -> RunConfig:
    try:
        return load_config(path)
    except ConfigError as err:
        err_console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None


InitFromOpt = typer.Option(
    None, "--init-from",
    help="Start a new run from an exported or pretrained model (a directory or a .safetensors file, local or any "
    "fsspec URL): version 0 of every fragment takes its weights (sets model.init_from).",
)


def _with_init_from(cfg: RunConfig, init_from: str | None) -> RunConfig:
    if init_from is None:
        return cfg
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": init_from})})


@contextmanager
def _read_only_run(
    config: Path | None, run: str | None, ledger: str | None, store: str | None, refused: tuple[type[Exception], ...] = ()
) -> Iterator[RunContext]:
    """A run's context on a read-only ledger engine (--ledger / --store override the config); it never
    creates a ledger. An unknown run, an unreadable ledger or any of ``refused`` is one line and exit 2."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from ddiloco.platform.ledger import make_engine
    from ddiloco.platform.ledger.queries import UnknownRunError
    from ddiloco.platform.runtime import RunContext

    cfg = _config(config)
    if store:
        cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"url": store})})
    url = ledger or cfg.ledger.url.get_secret_value()
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and not (parsed.database and Path(parsed.database).is_file()):
        # Connecting would create an empty file.
        err_console.print(f"[red]error:[/red] no ledger file at {redact_url(url)}")
        raise typer.Exit(2)
    ctx = RunContext.open(cfg, run or cfg.name, engine=make_engine(url, read_only=True))
    try:
        yield ctx
    except (UnknownRunError, *refused) as err:
        err_console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    except SQLAlchemyError as err:
        err_console.print(f"[red]error:[/red] {redact_url(f'cannot read the ledger at {url}: {str(err).splitlines()[0]}')}")
        raise typer.Exit(2) from None
    finally:
        ctx.engine.dispose()


def _ledger_url(ledger: str | None, config: Path | None) -> str:
    return ledger or _config(config).ledger.url.get_secret_value()


@ledger_app.command("upgrade")
def ledger_upgrade(ledger: str | None = LedgerOpt, config: Path | None = ConfigOpt) -> None:
    """Create or migrate the ledger schema to the newest revision."""
    from ddiloco.platform.ledger import make_engine, upgrade

    url = _ledger_url(ledger, config)
    upgrade(make_engine(url))
    console.print(f"ledger at {redact_url(url)} is at the newest schema revision")


@ledger_app.command("check")
def ledger_check(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run", help="Run id; defaults to the config's name."),
    ledger: str | None = LedgerOpt,
    store: str | None = typer.Option(None, "--store", help="Fragment store URL; defaults to the config's storage.url."),
) -> None:
    """Check a run's invariants against its store, read-only: prints "ok", or every problem and exits 1."""

    from ddiloco.platform.invariants import check_run

    with _read_only_run(config, run, ledger, store) as ctx:
        problems = check_run(ctx)
    for problem in problems:
        typer.echo(str(problem))
    if problems:
        raise typer.Exit(1)
    typer.echo(f"ok: run {ctx.run_id} holds every invariant")


@app.command("runs")
def runs(ledger: str | None = LedgerOpt, config: Path | None = ConfigOpt) -> None:
    """List the runs in the ledger."""
    from ddiloco.platform.ledger import open_ledger, session_factory
    from ddiloco.platform.ledger import queries as q

    engine = open_ledger(_ledger_url(ledger, config))
    table = Table("run", "status", "created", "fragments", "versions", "tokens")
    with session_factory(engine).begin() as s:
        for r in q.list_runs(s):
            versions = sum(q.latest_version_numbers(s, r.id).values())
            table.add_row(
                r.id,
                r.status,
                r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                str(r.num_fragments),
                str(versions),
                str(q.token_accounting(s, r.id).trained),
            )
    console.print(table)


@store_app.command("check")
def store_check(url: str = typer.Argument(..., help="fsspec URL of the store root, e.g. file://./store or s3://bucket/prefix")) -> None:
    """Round-trip self-check: write, read back, verify, refuse an overwrite, delete."""
    import torch

    from ddiloco.platform.store import BlobExistsError, FragmentStore

    store = FragmentStore(url)
    key = f"selfcheck/{uuid.uuid4().hex}.safetensors"
    tensors = {"w": torch.arange(1024, dtype=torch.float32).reshape(32, 32)}
    info = store.put(key, tensors)
    back = store.get(key, info.sha256)
    ok = torch.equal(back["w"], tensors["w"])
    try:
        store.put(key, {"w": torch.zeros(1)})
        immutable = False
    except BlobExistsError:
        immutable = True
    store.delete(key)
    gone = not store.exists(key)
    console.print(
        f"store {url}: round trip {'ok' if ok else 'FAILED'}, immutable {'ok' if immutable else 'FAILED'}, "
        f"delete {'ok' if gone else 'FAILED'}"
    )
    if not (ok and immutable and gone):
        raise typer.Exit(1)


@data_app.command("prepare")
def data_prepare(
    out: str = typer.Option(..., "--out", help="Folder or fsspec URL for the shards and manifest.json (file://, s3://, gs://)."),
    input_: str | None = typer.Option(None, "--input", help="Glob or URL of .txt / .jsonl / .parquet files, or 'stdlib'."),
    hf_dataset: str | None = typer.Option(None, "--hf-dataset", help="A Hugging Face dataset (save_to_disk folder or load_dataset path)."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="A tokenizer.json or a tokenizer directory."),
    train_tokenizer: int | None = typer.Option(None, "--train-tokenizer", min=260, help="Train a byte-level BPE of this vocabulary."),
    shard_tokens: int = typer.Option(50_000_000, "--shard-tokens", min=1, help="Tokens per training shard."),
    val_fraction: float = typer.Option(0.01, "--val-fraction", help="Share of documents in the validation shard."),
    text_column: str = typer.Option("text", "--text-column", help="The text field of jsonl / parquet / datasets."),
    hf_split: str = typer.Option("train", "--hf-split"),
    fmt: str = typer.Option("bin", "--format", help="bin (flat uint16/uint32) or parquet (a token-list column)."),
    max_bytes: int | None = typer.Option(None, "--max-bytes", help="Cap on the text read (--input stdlib only)."),
) -> None:
    """Tokenize a corpus into token shards and a manifest.json that data.manifest points at."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ddiloco.data_prepare import file_corpus, hf_corpus, prepare

    try:
        if (input_ is None) == (hf_dataset is None):
            raise ConfigError("give exactly one of --input and --hf-dataset")
        corpus = file_corpus(input_, text_column, max_bytes) if input_ else hf_corpus(hf_dataset or "", hf_split, text_column)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tokens]:,} tokens"),
                      TimeElapsedColumn(), console=err_console) as bar:
            task = bar.add_task("tokenizing", total=corpus.count, tokens=0)
            manifest = prepare(
                corpus, out, tokenizer=tokenizer, train_tokenizer=train_tokenizer, shard_tokens=shard_tokens,
                val_fraction=val_fraction, fmt=fmt, progress=lambda docs, toks: bar.update(task, completed=docs, tokens=toks),
            )
    except ConfigError as err:
        err_console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    console.print(
        f"{len(manifest.train)} training shard(s), {manifest.train_tokens:,} tokens; validation {manifest.val.tokens:,} tokens; "
        f"vocabulary {manifest.vocab_size} ({manifest.dtype}); manifest {out.rstrip('/')}/manifest.json"
    )


@app.command("learner")
def learner(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(
        None,
        "--run",
        "--run-id",
        help="Run id; defaults to the config's name. (Under torchrun write --run-id: torchrun reads --run as its --run-path.)",
    ),
    learner_id: str = typer.Option(..., "--learner", help="Learner id as listed by the config (e.g. us-0)."),
    max_steps: int | None = typer.Option(None, help="Stop after this many inner steps."),
    nproc_per_node: int | None = typer.Option(
        None,
        "--nproc-per-node",
        min=1,
        help="Ranks of this learner on this machine, launched through torchrun: every rank trains with DDP "
        "(gloo on CPU, NCCL on GPUs); rank 0 alone talks to the ledger and the store. Defaults to the "
        "config's learners.nproc_per_node. See docs/ddp.md.",
    ),
    summary_json: Path | None = typer.Option(None, "--summary-json", hidden=True, help="Rank 0 writes its job summary here."),
    flow_run_url: str | None = typer.Option(None, "--flow-run-url", hidden=True, help="Prefect flow run of this learner."),
    verbose: bool = False,
) -> None:
    """Run one learner until the run ends (SIGTERM finishes its uploads and stops it)."""
    _setup_logging(verbose)
    cfg = _config(config)
    try:
        # Bad input is refused before torch is imported: in a second, not in several.
        cfg.learners.resolve(learner_id)
    except ConfigError as err:
        err_console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    from ddiloco.learner_worker.launch import LearnerJobFailed, run_learner

    try:
        run_learner(
            cfg,
            run or cfg.name,
            learner_id,
            max_steps=max_steps,
            nproc_per_node=nproc_per_node or cfg.learners.nproc_per_node,
            summary_path=str(summary_json) if summary_json else None,
            flow_run_url=flow_run_url,
        )
    except ConfigError as err:
        err_console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    except LearnerJobFailed as err:
        err_console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(1) from None


@app.command("synchronizer")
def synchronizer(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run", help="Run id; defaults to the config's name."),
    label: str = typer.Option("sync", "--label", "--holder", help="Label in the lease holder name (label@host:pid)."),
    init_from: str | None = InitFromOpt,
    verbose: bool = False,
) -> None:
    """Run a synchronizer: active while it holds the run's lease, a hot standby otherwise."""
    from ddiloco.synchronizer.process import run_synchronizer

    _setup_logging(verbose)
    cfg = _with_init_from(_config(config), init_from)
    try:
        run_synchronizer(cfg, run or cfg.name, label)
    except ConfigError as err:
        err_console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None


@app.command("evaluate")
def evaluate_command(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run", help="Run id; defaults to the config's name."),
    verbose: bool = False,
) -> None:
    """Run the evaluator: evaluate newly published global versions every synchronizer.eval_every_s, record them, stop when the run ends."""
    from ddiloco.platform.runtime import RunContext
    from ddiloco.synchronizer.evaluator import run_evaluator

    _setup_logging(verbose)
    cfg = _config(config)
    run_evaluator(RunContext.open(cfg, run or cfg.name))


@app.command("summary")
def summary(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run"),
    ledger: str | None = LedgerOpt,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """A run's headline figures from the ledger."""
    import time

    from ddiloco.platform.ledger import open_ledger, session_factory
    from ddiloco.platform.runtime import to_datetime
    from ddiloco.platform.summary import run_summary

    cfg = _config(config)
    engine = open_ledger(ledger or cfg.ledger.url)
    with session_factory(engine).begin() as s:
        result = run_summary(s, run or cfg.name, to_datetime(time.time()))
    if as_json:
        console.print_json(result.to_json())
    else:
        from ddiloco.demo import summary_table

        console.print(summary_table(result))


@app.command("export")
def export_command(
    to: str = typer.Option(..., "--to", help="Directory or fsspec URL to write; must not exist yet or be empty."),
    fmt: str = typer.Option("safetensors", "--format", help="hf (a save_pretrained directory; model.kind hf) or safetensors."),
    version: str = typer.Option("latest", "--version", help="latest, or N: every fragment's newest version <= N."),
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run", help="Run id; defaults to the config's name."),
    ledger: str | None = LedgerOpt,
    store: str | None = typer.Option(None, "--store", help="Fragment store URL; defaults to the config's storage.url."),
) -> None:
    """Write a run's global model (newest or version N) as safetensors or a Hugging Face directory; read-only."""

    from ddiloco.export import ExportError, export_run
    from ddiloco.platform.models.weights import WeightsError
    from ddiloco.platform.store import StoreError

    if fmt not in ("hf", "safetensors"):
        err_console.print(f"[red]error:[/red] --format must be hf or safetensors, got {fmt!r}")
        raise typer.Exit(2)
    if version != "latest" and not version.isdigit():
        err_console.print(f"[red]error:[/red] --version must be latest or a version number, got {version!r}")
        raise typer.Exit(2)
    with _read_only_run(config, run, ledger, store, refused=(ExportError, ConfigError, WeightsError, StoreError)) as ctx:
        done = export_run(ctx, to=to, fmt=fmt, version=None if version == "latest" else int(version))  # type: ignore[arg-type]
    versions = sorted(set(done.versions.values()))
    console.print(f"exported run {ctx.run_id} ({len(done.versions)} fragments, versions {versions[0]}..{versions[-1]}) "
                  f"to {redact_url(done.to)}: {', '.join(done.files)}")


@app.command("config")
def show_config(config: Path | None = ConfigOpt) -> None:
    """Validate a config and print the effective values (file + env overrides)."""
    from ddiloco.platform.tokenize import check_vocab

    cfg = _config(config)
    try:
        check_vocab(cfg.model, cfg.data)
    except ConfigError as err:
        err_console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    console.print_json(json.dumps(cfg.model_dump(mode="json")))


@app.command("demo")
def demo(
    learners: int = typer.Option(4, "--learners", min=1, help="Learners, split over two regions (us, eu); one runs 2x slower."),
    seconds: float = typer.Option(150.0, "--seconds", min=10, help="Training time."),
    chaos: bool = typer.Option(True, "--chaos/--no-chaos", help="Kill a learner and the active synchronizer mid-run."),
    config: Path | None = ConfigOpt,
    workdir: Path = typer.Option(Path("ddiloco-runs"), help="Where the ledger and the store go."),
    summary_json: Path | None = typer.Option(None, "--summary-json", help="Also write the summary as JSON."),
    init_from: str | None = InitFromOpt,
) -> None:
    """Train a byte-level GPT with 4 learner processes in 2 regions, a synchronizer and a standby, surviving failures."""
    from ddiloco.demo import DemoOptions, run_demo

    base = _with_init_from(_config(config), init_from) if config or init_from else None
    result = run_demo(DemoOptions(learners=learners, seconds=seconds, chaos=chaos, workdir=workdir, base_config=base), console)
    if summary_json:
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        summary_json.write_text(result.to_json())
        console.print(f"summary written to {summary_json}")


@app.command("deploy")
def deploy_command(
    config: Path | None = ConfigOpt,
    cron: str | None = typer.Option(None, help="Cron schedule for the training-run deployment, e.g. '0 3 * * *'."),
    pool_type: str = typer.Option("process", help="Work pool type for the region pools (process, kubernetes, ecs, cloud-run)."),
    secret_block: list[str] = typer.Option([], "--secret-block", help="ENV_VAR=block-name: flow runs read ENV_VAR from that "
                                           "Prefect Secret block (e.g. DDILOCO_LEDGER__URL=ddiloco-ledger-url); repeatable."),
) -> None:
    """Create one work pool per region and the learner, synchronizer and training-run deployments (PREFECT_API_URL)."""
    from ddiloco.flows.deploy import deploy, parse_secret_blocks

    cfg = _config(config)
    try:
        plan = deploy(cfg, cron=cron, pool_type=pool_type, secret_blocks=parse_secret_blocks(secret_block))
    except ValueError as err:
        err_console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    console.print(f"work pools: {', '.join(plan.pools)}")
    console.print(f"deployments: {', '.join(plan.deployments)}")
    console.print("start one worker per region: prefect worker start --pool region-<name>")


@app.command("chaos-suite")
def chaos_suite_command(
    quick: bool = typer.Option(False, "--quick", help="The short version CI runs (shorter outages, fewer faults)."),
    json_path: Path | None = typer.Option(None, "--json", help="Write {faults: [...], invariants_ok} here."),
    postgres_url: str | None = typer.Option(None, help="Admin URL of the PostgreSQL server to create a scratch ledger on."),
    workdir: Path | None = typer.Option(None, help="Where process logs go (a temporary folder by default)."),
) -> None:
    """Inject faults into a live run on PostgreSQL + S3 (moto) + OS processes and check the invariants after each."""
    from ddiloco.chaos_suite import report_json, run_suite

    _setup_logging()
    report = run_suite(quick=quick, postgres_url=postgres_url, workdir=workdir)
    table = Table("fault", "injected", "survived", "lost", "recover s", "detail")
    for f in report.faults:
        table.add_row(
            f.fault, str(f.injected), str(f.survived), str(f.lost), f"{f.recover_s:.1f}" if f.recover_s is not None else "-", f.detail[:80]
        )
    console.print(table)
    console.print(f"invariants: {'ok' if report.invariants_ok else 'BROKEN'}")
    for problem in report.problems:
        console.print(f"  [red]{problem}[/red]")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(report_json(report))
    if not report.passed:
        raise typer.Exit(1)


app.command("simulate", help="Goodput of data-parallel vs Decoupled DiLoCo at scale, under chip failures.")(simulate_command)
app.command("ui", help="Serve the operations dashboard for a ledger (Streamlit, read-only).")(ui_command)


if __name__ == "__main__":
    app()
