"""The ``ddiloco`` command: one entry point for every process and tool."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import quote

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ddiloco.bench.command import bench_app
from ddiloco.platform.config import ConfigError, RunConfig, load_config, world_size_problem
from ddiloco.platform.redact import RedactingFilter, mask_tree, redact_url
from ddiloco.simulator.command import simulate_command
from ddiloco.ui.command import ui_command

if TYPE_CHECKING:  # the runtime stays unimported until a command needs it (bad input is refused in a second)
    from sqlalchemy import Engine

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
        err_console.print(f"[red]error:[/red] {escape(str(err))}")
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
    from sqlalchemy.exc import SQLAlchemyError

    from ddiloco.platform.ledger import errors as errors_q
    from ddiloco.platform.runtime import RunContext

    cfg = _config(config)
    if store:
        cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"url": store})})
    url = ledger or cfg.ledger.url.get_secret_value()
    run_id = _checked_id(run or cfg.name, "run")
    ctx = RunContext.open(cfg, run_id, engine=_existing_ledger(url))
    try:
        yield ctx
    except (errors_q.UnknownRunError, *refused) as err:
        err_console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2) from None
    except SQLAlchemyError as err:
        err_console.print(f"[red]error:[/red] {escape(redact_url(f'cannot read the ledger at {url}: {str(err).splitlines()[0]}'))}")
        raise typer.Exit(2) from None
    finally:
        ctx.engine.dispose()


def _ledger_url(ledger: str | None, config: Path | None) -> str:
    return ledger or _config(config).ledger.url.get_secret_value()


def _refuse(message: str) -> NoReturn:
    # Escaped: the message quotes what the user typed, and "[x](…)" is not Rich markup either.
    err_console.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(2)


def _plain(url: Any) -> str:
    """A URL from the config, whether kept as a plain string or a pydantic SecretStr."""
    return url.get_secret_value() if hasattr(url, "get_secret_value") else url


def _checked_id(value: str, what: str) -> str:
    from ddiloco.platform.ids import InvalidIdError, validate_id

    try:
        return validate_id(value, what)
    except InvalidIdError as err:
        _refuse(str(err))


def _existing_ledger(url: str) -> Engine:
    """A read-only engine on a ledger that exists at the newest schema: a read command never creates,
    overwrites or migrates one (``ddiloco ledger upgrade`` does)."""
    from alembic.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError
    from sqlalchemy.pool import NullPool

    from ddiloco.platform.ledger import make_engine
    from ddiloco.platform.ledger.engine import alembic_config

    try:
        parsed = make_url(url)
    except ArgumentError:
        _refuse(f"not a ledger URL: {redact_url(url)}")
    if parsed.get_backend_name() == "sqlite":
        if not (parsed.database and Path(parsed.database).is_file()):
            _refuse(f"no ledger file at {redact_url(url)}")
        with open(parsed.database, "rb") as f:
            # Even a read-only connection would turn an empty file into a database (WAL mode is persistent).
            if f.read(16) != b"SQLite format 3\x00":
                _refuse(f"{parsed.database} is not a ledger (not a SQLite database)")
        # Opened read-only by SQLite itself: the platform's engine would switch a foreign database to WAL.
        probe = create_engine(f"sqlite:///file:{quote(parsed.database)}?mode=ro&uri=true", poolclass=NullPool)
    else:
        probe = make_engine(url, read_only=True)
    try:
        with probe.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    except SQLAlchemyError as err:
        _refuse(redact_url(f"cannot read the ledger at {url}: {str(err).splitlines()[0]}"))
    finally:
        probe.dispose()
    engine = make_engine(url, read_only=True)
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if current != head:
        engine.dispose()
        what = "holds no ledger" if current is None else f"is at schema revision {current}, this code reads {head}"
        _refuse(f"the database at {redact_url(url)} {what}: `ddiloco ledger upgrade --ledger URL` creates or migrates it")
    return engine


WAIT_S = 30.0
"""How long a process waits for its ledger and store before it gives up (bounded retries, one line each)."""
WaitOpt = typer.Option(WAIT_S, "--wait-s", min=0.0, help="Give up when the ledger or the store cannot be reached for this long.")


def _probe_within(probe: Callable[[], object], timeout_s: float) -> None:
    """Run ``probe`` in a daemon thread; raise TimeoutError when it has not answered in time (clients may retry for minutes)."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            probe()
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            outcome.append(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"no answer within {timeout_s:.0f}s")
    if outcome[0] is not None:
        raise outcome[0]


def _probe_ledger(url: str) -> Callable[[], object]:
    def probe() -> None:
        from sqlalchemy import create_engine, text
        from sqlalchemy.pool import NullPool

        engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 5})
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        finally:
            engine.dispose()

    return probe


def _probe_store(url: str) -> Callable[[], object]:
    def probe() -> None:
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(url)
        fs.exists(root)

    return probe


def _wait_until_reachable(cfg: RunConfig, regions: list[str | None], wait_s: float) -> None:
    """The ledger (PostgreSQL) and the stores answer, or exit 2 after ``wait_s``: bounded retries, a
    visible "waiting for …" line per failed attempt, never a silent hang."""
    from tenacity import Retrying, stop_after_delay, wait_exponential

    targets = []
    ledger = _plain(cfg.ledger.url)
    if ledger.startswith("postgresql"):
        targets.append(("ledger", ledger, _probe_ledger(ledger)))
    for url in dict.fromkeys(cfg.storage_url_for(r) for r in regions):
        targets.append(("store", url, _probe_store(url)))
    for what, url, probe in targets:
        shown = redact_url(url)

        def waiting(state: Any, what: str = what, shown: str = shown) -> None:
            err = state.outcome.exception()
            reason = redact_url(" ".join(str(err).split())[:200]) or type(err).__name__
            err_console.print(escape(f"waiting for the {what} at {shown} (attempt {state.attempt_number}): {reason}"))

        try:
            for attempt in Retrying(stop=stop_after_delay(wait_s), wait=wait_exponential(multiplier=0.5, max=5),
                                    before_sleep=waiting, reraise=True):
                with attempt:
                    _probe_within(probe, max(1.0, min(10.0, wait_s)))
        except Exception as err:  # noqa: BLE001 - whatever the client raised, it is one line
            reason = redact_url(" ".join(str(err).split())[:200]) or type(err).__name__
            _refuse(f"cannot reach the {what} at {shown} within {wait_s:g}s: {reason}")


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


@ledger_app.command("roles")
def ledger_roles(
    ledger: str | None = LedgerOpt,
    config: Path | None = ConfigOpt,
    prefix: str = typer.Option("ddiloco", "--prefix", help="Roles are named PREFIX_synchronizer, _evaluator, _dashboard, _learner."),
    learners: list[str] = typer.Option([], "--learner", help="A learner id that gets its login role PREFIX_learner_ID (repeatable)."),
    logins: list[str] = typer.Option(
        [], "--login", help="KIND=NAME: a login role NAME in group synchronizer, evaluator or dashboard (repeatable)."
    ),
    password_env: str | None = typer.Option(
        None, "--password-env", help="Name of an environment variable holding the password of the login roles this run creates."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the SQL instead of running it (passwords masked)."),
) -> None:
    """Create or update least-privilege roles on a PostgreSQL ledger: grants and row-level security per process."""
    from alembic.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
    from sqlalchemy.pool import NullPool

    from ddiloco.platform.ledger import roles
    from ddiloco.platform.ledger.engine import alembic_config

    url = _ledger_url(ledger, config)
    try:
        backend = make_url(url).get_backend_name()
    except ArgumentError:
        _refuse(f"not a ledger URL: {redact_url(url)}")
    if backend != "postgresql":
        _refuse(f"ledger roles needs a PostgreSQL ledger: {backend} has no roles ({redact_url(url)})")
    pairs = []
    for item in logins:
        kind, eq, name = item.partition("=")
        if not eq:
            _refuse(f"--login {item!r}: write KIND=NAME, e.g. dashboard=ops_dashboard")
        pairs.append((kind, name))
    try:
        plan = roles.RolePlan(prefix, tuple(dict.fromkeys(learners)), tuple(dict.fromkeys(pairs)))
    except ValueError as err:
        _refuse(str(err))
    password = None
    if password_env is not None:
        password = os.environ.get(password_env)
        if not password:
            _refuse(f"--password-env {password_env}: that environment variable is not set or is empty")
        if not plan.login_roles():
            _refuse("--password-env sets the password of login roles: name them with --learner or --login")
    try:
        engine = create_engine(url, poolclass=NullPool)
    except (ImportError, NoSuchModuleError) as err:
        _refuse(f"cannot open {redact_url(url)}: {err} (install the postgres extra)")
    try:
        with engine.begin() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
            head = ScriptDirectory.from_config(alembic_config()).get_current_head()
            if current != head:
                _refuse(f"the ledger at {redact_url(url)} is at schema revision {current}, not {head}: run `ddiloco ledger upgrade` first")
            schema = conn.execute(text("SELECT current_schema()")).scalar_one()
            driver = conn.connection.driver_connection
            verifiers = {}
            for _, name in plan.login_roles() if password else ():
                # libpq hashes the password here: the server, its logs and the dry run never see it.
                verifiers[name] = driver.pgconn.encrypt_password(password.encode(), name.encode(), b"scram-sha-256").decode()
            plan = roles.RolePlan(plan.prefix, plan.learners, plan.logins, schema, verifiers)
            if dry_run:
                typer.echo(roles.shown(plan), nl=False)
                return
            for statement in roles.statements(plan):
                # Through the driver without parameters: the function bodies' '%' are not placeholders.
                driver.execute(statement)
    except (SQLAlchemyError, engine.dialect.loaded_dbapi.Error) as err:
        _refuse(redact_url(f"ledger roles on {url} failed: {str(err).splitlines()[0]}"))
    finally:
        engine.dispose()
    typer.echo(f"roles {', '.join(plan.group(kind) for kind in roles.GROUPS)} set up on {redact_url(url)}")
    for kind, name in plan.login_roles():
        typer.echo(f"  login {name} in {plan.group(kind)}" + (" (password set)" if name in plan.passwords else ""))


@app.command("runs")
def runs(ledger: str | None = LedgerOpt, config: Path | None = ConfigOpt) -> None:
    """List the runs in the ledger (read-only: a missing or outdated ledger is refused, never created or migrated)."""
    from ddiloco.platform.ledger import reports as reports_q
    from ddiloco.platform.ledger import runs as runs_q
    from ddiloco.platform.ledger import session_factory

    engine = _existing_ledger(_plain(_ledger_url(ledger, config)))
    table = Table("run", "status", "created", "fragments", "versions", "tokens")
    with session_factory(engine).begin() as s:
        for r in runs_q.list_runs(s):
            versions = sum(runs_q.latest_version_numbers(s, r.id).values())
            table.add_row(
                r.id,
                r.status,
                r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                str(r.num_fragments),
                str(versions),
                str(reports_q.token_accounting(s, r.id).trained),
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
        f"store {redact_url(url)}: round trip {'ok' if ok else 'FAILED'}, immutable {'ok' if immutable else 'FAILED'}, "
        f"delete {'ok' if gone else 'FAILED'}"
    )
    if not (ok and immutable and gone):
        raise typer.Exit(1)


@data_app.command("prepare")
def data_prepare(
    out: str = typer.Option(..., "--out", help="Folder or fsspec URL for the shards and manifest.json (file://, s3://, gs://)."),
    input_: str | None = typer.Option(None, "--input", help="Glob or URL of .txt / .jsonl / .parquet files, 'stdlib', or "
                                      "'site-packages' (the installed packages' Python sources, split by package)."),
    hf_dataset: str | None = typer.Option(None, "--hf-dataset", help="A Hugging Face dataset (save_to_disk folder or load_dataset path)."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="A tokenizer.json or a tokenizer directory."),
    train_tokenizer: int | None = typer.Option(None, "--train-tokenizer", min=260, help="Train a byte-level BPE of this vocabulary."),
    shard_tokens: int = typer.Option(50_000_000, "--shard-tokens", min=1, help="Tokens per training shard."),
    val_fraction: float = typer.Option(0.01, "--val-fraction", help="Share of documents in the validation shard."),
    text_column: str = typer.Option("text", "--text-column", help="The text field of jsonl / parquet / datasets."),
    hf_split: str = typer.Option("train", "--hf-split"),
    fmt: str = typer.Option("bin", "--format", help="bin (flat uint16/uint32) or parquet (a token-list column)."),
    max_bytes: int | None = typer.Option(None, "--max-bytes", help="Cap on the text read (--input stdlib or site-packages only)."),
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
        err_console.print(f"[red]error:[/red] {escape(str(err))}")
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
    wait_s: float = WaitOpt,
    verbose: bool = False,
) -> None:
    """Run one learner until the run ends (SIGTERM finishes its uploads and stops it)."""
    _setup_logging(verbose)
    cfg = _config(config)
    run = _checked_id(run or cfg.name, "run")
    try:
        # Bad input is refused before torch is imported: in a second, not in several.
        _, region, _ = cfg.learners.resolve(learner_id)
        why = world_size_problem(nproc_per_node, cfg.learners.max_world_size) if nproc_per_node else None
        if why:
            raise ConfigError(f"--nproc-per-node: {why}")
    except ConfigError as err:
        err_console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2) from None
    _wait_until_reachable(cfg, [region], wait_s)
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
        err_console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2) from None
    except LearnerJobFailed as err:
        err_console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(1) from None


@app.command("synchronizer")
def synchronizer(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run", help="Run id; defaults to the config's name."),
    label: str = typer.Option("sync", "--label", "--holder", help="Label in the lease holder name (label@host:pid)."),
    shard: int | None = typer.Option(None, "--shard", min=0, help="Serve only this shard (0..synchronizer.shards-1); "
                                     "default: whichever shard's lease is free."),
    init_from: str | None = InitFromOpt,
    wait_s: float = WaitOpt,
    verbose: bool = False,
) -> None:
    """Run a synchronizer: active while it holds a shard's lease (one shard unless synchronizer.shards > 1), else a hot standby."""
    _setup_logging(verbose)
    cfg = _with_init_from(_config(config), init_from)
    run = _checked_id(run or cfg.name, "run")
    _checked_id(label, "synchronizer label")
    if shard is not None and shard >= cfg.synchronizer.shards:
        _refuse(f"--shard {shard}: the run has {cfg.synchronizer.shards} synchronizer shard(s), numbered from 0")
    _wait_until_reachable(cfg, [None, *(r.name for r in cfg.learners.regions)], wait_s)
    from ddiloco.synchronizer.process import run_synchronizer

    try:
        run_synchronizer(cfg, run or cfg.name, label, shard=shard)
    except ConfigError as err:
        err_console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2) from None


@app.command("evaluate")
def evaluate_command(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run", help="Run id; defaults to the config's name."),
    device: str = typer.Option("auto", "--device", help="auto (the GPU when torch sees one), cpu, cuda or cuda:N."),
    wait_s: float = WaitOpt,
    verbose: bool = False,
) -> None:
    """Run the evaluator: evaluate newly published global versions every synchronizer.eval_every_s, record them, stop when the run ends."""
    _setup_logging(verbose)
    cfg = _config(config)
    run = _checked_id(run or cfg.name, "run")
    _wait_until_reachable(cfg, [None], wait_s)
    from ddiloco.platform.runtime import RunContext
    from ddiloco.synchronizer.evaluator import run_evaluator

    try:
        run_evaluator(RunContext.open(cfg, run), device=device)
    except ValueError as err:
        err_console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2) from None


@app.command("summary")
def summary(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run"),
    ledger: str | None = LedgerOpt,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """A run's headline figures from the ledger."""
    import time

    from ddiloco.platform.ledger import session_factory
    from ddiloco.platform.runtime import to_datetime
    from ddiloco.platform.summary import run_summary

    cfg = _config(config)
    run = _checked_id(run or cfg.name, "run")
    engine = _existing_ledger(ledger or _plain(cfg.ledger.url))
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
        err_console.print(f"[red]error:[/red] --format must be hf or safetensors, got {escape(repr(fmt))}")
        raise typer.Exit(2)
    if version != "latest" and not version.isdigit():
        err_console.print(f"[red]error:[/red] --version must be latest or a version number, got {escape(repr(version))}")
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
        err_console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2) from None
    console.print_json(json.dumps(mask_tree(cfg.model_dump(mode="json"))))


ENV_STORAGE = ("DDILOCO_LEDGER__URL", "DDILOCO_STORAGE__URL")
EnvStorageOpt = typer.Option(
    False, "--env-storage",
    help="Use DDILOCO_LEDGER__URL / DDILOCO_STORAGE__URL from the environment instead of a scratch ledger and store.",
)


def _scratch_storage_only(use_env: bool, what: str) -> None:
    """Drop exported ledger and store URLs (for this process and its children) unless told to use them:
    a scratch run must never write to, restart or kill what an exported URL points at."""
    if use_env:
        return
    for key in [k for k in os.environ if k.upper() in ENV_STORAGE]:
        del os.environ[key]
        err_console.print(f"{what} ignores {key} from the environment (its own scratch storage; --env-storage uses it)")


def _check_writable(path: Path, option: str) -> None:
    """Refuse an output path that cannot be written, before any work starts."""
    if path.is_dir():
        _refuse(f"{option} {path} is a directory, not a file")
    parent = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    if not parent.is_dir():
        _refuse(f"{option} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        _refuse(f"{option} {path}: {parent} is not writable")


@app.command("demo")
def demo(
    learners: int = typer.Option(4, "--learners", min=1, help="Learners, split over two regions (us, eu); one runs 2x slower."),
    seconds: float = typer.Option(150.0, "--seconds", min=10, help="Training time."),
    chaos: bool = typer.Option(True, "--chaos/--no-chaos", help="Kill a learner and the active synchronizer mid-run."),
    config: Path | None = ConfigOpt,
    workdir: Path = typer.Option(Path("ddiloco-runs"), help="Where the ledger and the store go."),
    summary_json: Path | None = typer.Option(None, "--summary-json", help="Also write the summary as JSON."),
    init_from: str | None = InitFromOpt,
    env_storage: bool = EnvStorageOpt,
) -> None:
    """Train a byte-level GPT with 4 learner processes in 2 regions, a synchronizer and a standby, surviving failures."""
    from ddiloco.demo import DemoOptions, run_demo

    if summary_json is not None:
        _check_writable(summary_json, "--summary-json")
    _scratch_storage_only(env_storage, "the demo")

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
    base_job_template: Path | None = typer.Option(None, help="Base job template of new pools, e.g. infra/work-pools/kubernetes.json."),
    notify_block: str | None = typer.Option(None, help="TYPE/NAME of a Prefect notification block (e.g. slack-webhook/ops): "
                                            "create the alerts' automations, sending through it."),
    stall_minutes: float = typer.Option(10.0, help="Alert when a run publishes no global version for this many minutes "
                                         "(fractions allowed, at least 0.17: 10 s)."),
    relaunches_per_hour: int = typer.Option(3, help="Alert when a learner is relaunched more often than this within an hour."),
) -> None:
    """Create one work pool per region and the learner, synchronizer and training-run deployments (PREFECT_API_URL)."""
    try:
        from prefect.settings import PREFECT_API_URL
    except ModuleNotFoundError:
        _refuse("Prefect is not installed: pip install 'ddiloco[flows]'")

    if not PREFECT_API_URL.value():
        # Otherwise Prefect starts a temporary server that vanishes, deployments and all, when this command exits.
        _refuse("no Prefect API configured: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api) or log in to Prefect Cloud")
    from ddiloco.flows.alerts import AlertPolicy
    from ddiloco.flows.deploy import deploy, parse_secret_blocks, read_job_template

    cfg = _config(config)
    try:
        plan = deploy(cfg, cron=cron, pool_type=pool_type, secret_blocks=parse_secret_blocks(secret_block),
                      base_job_template=read_job_template(base_job_template) if base_job_template else None,
                      notify_block=notify_block, alert_policy=AlertPolicy(stall_minutes, relaunches_per_hour))
    except ValueError as err:
        err_console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2) from None
    console.print(f"work pools: {', '.join(plan.pools)}")
    console.print(f"deployments: {', '.join(plan.deployments)}")
    if plan.automations:
        console.print(f"alerts: {', '.join(plan.automations)} -> {notify_block}")
    console.print("start one worker per region: prefect worker start --pool region-<name>")


@app.command("chaos-suite")
def chaos_suite_command(
    quick: bool = typer.Option(False, "--quick", help="The short version CI runs (shorter outages, fewer faults)."),
    json_path: Path | None = typer.Option(None, "--json", help="Write {faults: [...], invariants_ok} here."),
    postgres_url: str | None = typer.Option(None, help="Admin URL of the PostgreSQL server to create a scratch ledger on."),
    workdir: Path | None = typer.Option(None, help="Where process logs go (a temporary folder by default)."),
    shards: int = typer.Option(1, "--shards", min=1, max=4, help="Synchronizer shards (each kill takes the next shard's holder)."),
    env_storage: bool = EnvStorageOpt,
) -> None:
    """Inject faults into a live run on PostgreSQL + S3 (moto) + OS processes and check the invariants after each."""
    from ddiloco.testing.chaos_suite import report_json, run_suite

    if json_path is not None:
        _check_writable(json_path, "--json")
    # The suite restarts database servers and kills processes: never against an exported production URL.
    _scratch_storage_only(env_storage, "the chaos suite")
    _setup_logging()
    report = run_suite(quick=quick, postgres_url=postgres_url, workdir=workdir, shards=shards)
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
