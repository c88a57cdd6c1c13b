"""``ddiloco ledger``, ``run``, ``store`` and ``data``: the administration sub-commands, and what every command shares (one-line
refusals, the config, options, the read-only ledger that read commands open)."""

from __future__ import annotations

import errno
import os
import sys
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import quote

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from ddiloco.entry import EntryError, checked_id, load
from ddiloco.platform.config import ConfigError, RunConfig
from ddiloco.platform.redact import redact_url

if TYPE_CHECKING:  # the runtime stays unimported until a command needs it (bad input is refused in a second)
    from sqlalchemy import Engine

    from ddiloco.platform.runtime import RunContext

ledger_app = typer.Typer(help="The SQL ledger.", no_args_is_help=True)
run_app = typer.Typer(help="End a run: for runs driven by hand (a training flow ends its own).", no_args_is_help=True)
store_app = typer.Typer(help="The fragment store.", no_args_is_help=True)
data_app = typer.Typer(help="Training data: tokenize a corpus into shards.", no_args_is_help=True)
console = Console()
# Errors stay one line however narrow the terminal (or log collector) is.
err_console = Console(stderr=True, soft_wrap=True)

ConfigOpt = typer.Option(None, "--config", "-c", help="Run config (YAML or TOML); env DDILOCO_* overrides it.")
LedgerOpt = typer.Option(None, "--ledger", help="Ledger URL; defaults to the config's ledger.url.")
StoreOpt = typer.Option(None, "--store", help="Fragment store URL; defaults to the config's storage.url.")


def refuse(message: str) -> NoReturn:
    """``message`` as one line on stderr, credentials masked, and exit 2."""
    # Escaped: the message quotes what the user typed, and "[x](…)" is not Rich markup either.
    err_console.print(f"[red]error:[/red] {escape(redact_url(message))}")
    raise typer.Exit(2)


# --- an operator's mistake ends in one line, a bug in its traceback -------------------------------------

_OURS = frozenset({
    "ddiloco.entry.EntryError", "ddiloco.platform.config.ConfigError", "ddiloco.platform.ids.InvalidIdError",
    "ddiloco.platform.ledger.errors.UnknownRunError", "ddiloco.platform.store.StoreError", "ddiloco.export.ExportError",
})
"""Our refusals: their messages say what to fix already, whole (a config error lists its fields on lines of their own;
ConfigError covers WeightsError and CorruptShardError)."""

_REFUSED = {
    # The ledger's database: a URL SQLAlchemy cannot take, a server or file it cannot reach.
    "sqlalchemy.exc.ArgumentError": "not a ledger URL: {}",
    "sqlalchemy.exc.NoSuchModuleError": "unsupported ledger URL: {}",
    "sqlalchemy.exc.OperationalError": "cannot reach or read the ledger: {}",
    "sqlalchemy.exc.InterfaceError": "cannot reach or read the ledger: {}",
    # Object stores: credentials and endpoints.
    "botocore.exceptions.NoCredentialsError": "no object-store credentials: {} (set AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or storage.options)",
    "botocore.exceptions.PartialCredentialsError": "incomplete object-store credentials: {}",
    "botocore.exceptions.EndpointConnectionError": "cannot reach the object store: {}",
    "google.auth.exceptions.DefaultCredentialsError": "no Google Cloud credentials: {}",
}
"""Other libraries' exceptions an operator's mistake ends in, and the line it is told in (their message's first line).
Classes go by module and name, so judging one imports nothing; a subclass counts as its class."""

_OS_REFUSED = (FileNotFoundError, IsADirectoryError, NotADirectoryError, FileExistsError, PermissionError,
               ConnectionError, TimeoutError)
_ERRNO_REFUSED = frozenset({errno.ENOSPC, errno.EROFS, errno.ENAMETOOLONG, errno.ELOOP, errno.EDQUOT})
_PROTOCOL_REGISTRY = "fsspec.registry"
"""fsspec's ValueError ("Protocol not known") and ImportError ("Install s3fs …") for a URL's protocol come from here."""


def _first_line(err: BaseException) -> str:
    # SQLAlchemy appends "[SQL: …]" and a link on lines of their own; the first line says what went wrong.
    lines = str(err).strip().splitlines()
    return " ".join(lines[0].split())[:500] if lines else type(err).__name__


def _raised_in(err: BaseException) -> str:
    """The module of the innermost frame ``err`` was raised from."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")) if tb is not None else ""


def operator_error(err: BaseException) -> str | None:
    """The one line an ordinary operator mistake ends in (bad input; a ledger, store, credential or path that is not
    there), or None for an exception that is a bug and keeps its traceback."""
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(err).__mro__}
    if names & _OURS:
        return str(err)
    for name, shape in _REFUSED.items():
        if name in names:
            return shape.format(_first_line(err))
    if isinstance(err, OSError) and (isinstance(err, _OS_REFUSED) or err.errno in _ERRNO_REFUSED):
        if err.filename is None:
            return _first_line(err)
        paths = " -> ".join(str(f) for f in (err.filename, err.filename2) if f is not None)
        return f"{(err.strerror or type(err).__name__).lower()}: {paths}"
    if isinstance(err, (ValueError, ImportError)) and _raised_in(err) == _PROTOCOL_REGISTRY:
        return f"store URL: {_first_line(err)}"
    return None


def _is_cli_signal(err: BaseException) -> bool:
    """Typer's (or Click's) own exceptions: --help, usage errors, typer.Exit; they are the framework's to print."""
    return any(c.__module__.split(".")[0] in ("typer", "click") for c in type(err).__mro__)


class OperatorErrors(TyperGroup):
    """The ``ddiloco`` command group: whatever sub-command runs, an operator's mistake (:func:`operator_error`) ends
    in one masked ``error:`` line and exit 2; any other exception is a bug and keeps its traceback (credentials masked)
    and exit 1."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as err:  # noqa: BLE001 - judged below: refused, or shown in full
            if _is_cli_signal(err):
                raise
            message = operator_error(err)
            if message is None:
                sys.stderr.write(redact_url("".join(traceback.format_exception(err))))
                sys.stderr.flush()
                raise typer.Exit(1) from None
            refuse(message)


def load_or_exit(path: Path | None) -> RunConfig:
    """The run config (file + env overrides), or the field that is wrong as one line and exit 2."""
    try:
        return load(path)
    except EntryError as err:
        refuse(str(err))


def checked_id_or_exit(value: str, what: str) -> str:
    try:
        return checked_id(value, what)
    except EntryError as err:
        refuse(str(err))


def plain(url: Any) -> str:
    """A URL from the config, whether kept as a plain string or a pydantic SecretStr."""
    return url.get_secret_value() if hasattr(url, "get_secret_value") else url


def ledger_url(ledger: str | None, config: Path | None) -> str:
    return ledger or load_or_exit(config).ledger.url.get_secret_value()


@contextmanager
def read_only_run(
    config: Path | None, run: str | None, ledger: str | None, store: str | None, refused: tuple[type[Exception], ...] = ()
) -> Iterator[RunContext]:
    """A run's context on a read-only ledger engine (--ledger / --store override the config); it never
    creates a ledger. An unknown run, an unreadable ledger or any of ``refused`` is one line and exit 2."""
    from sqlalchemy.exc import SQLAlchemyError

    from ddiloco.platform.ledger import errors as errors_q
    from ddiloco.platform.runtime import RunContext

    cfg = load_or_exit(config)
    if store:
        cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"url": store})})
    url = ledger or cfg.ledger.url.get_secret_value()
    run_id = checked_id_or_exit(run or cfg.name, "run")
    ctx = RunContext.open(cfg, run_id, engine=existing_ledger(url))
    try:
        yield ctx
    except (errors_q.UnknownRunError, *refused) as err:
        refuse(str(err))
    except SQLAlchemyError as err:
        refuse(redact_url(f"cannot read the ledger at {url}: {str(err).splitlines()[0]}"))
    finally:
        ctx.engine.dispose()


def existing_ledger(url: str, *, write: bool = False) -> Engine:
    """An engine on a ledger that exists at the newest schema, read-only unless ``write``: a command never creates,
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
        refuse(f"not a ledger URL: {redact_url(url)}")
    if parsed.get_backend_name() == "sqlite":
        if not (parsed.database and Path(parsed.database).is_file()):
            refuse(f"no ledger file at {redact_url(url)}")
        with open(parsed.database, "rb") as f:
            # Even a read-only connection would turn an empty file into a database (WAL mode is persistent).
            if f.read(16) != b"SQLite format 3\x00":
                refuse(f"{parsed.database} is not a ledger (not a SQLite database)")
        # Opened read-only by SQLite itself: the platform's engine would switch a foreign database to WAL.
        probe = create_engine(f"sqlite:///file:{quote(parsed.database)}?mode=ro&uri=true", poolclass=NullPool)
    else:
        probe = make_engine(url, read_only=True)
    try:
        with probe.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    except SQLAlchemyError as err:
        refuse(redact_url(f"cannot read the ledger at {url}: {str(err).splitlines()[0]}"))
    finally:
        probe.dispose()
    engine = make_engine(url, read_only=not write)
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if current != head:
        engine.dispose()
        what = "holds no ledger" if current is None else f"is at schema revision {current}, this code reads {head}"
        refuse(f"the database at {redact_url(url)} {what}: `ddiloco ledger upgrade --ledger URL` creates or migrates it")
    return engine


@ledger_app.command("upgrade")
def ledger_upgrade(ledger: str | None = LedgerOpt, config: Path | None = ConfigOpt) -> None:
    """Create or migrate the ledger schema to the newest revision (a PostgreSQL ledger's least-privilege roles are
    granted what a migration added)."""
    from ddiloco.platform.ledger import make_engine, upgrade

    url = ledger_url(ledger, config)
    engine = make_engine(url)
    try:
        renewal = upgrade(engine)
    finally:
        engine.dispose()
    console.print(f"ledger at {redact_url(url)} is at the newest schema revision"
                  + (f"; the roles {renewal.prefix}_* were granted what it added" if renewal and not renewal.problem else ""))
    if renewal is not None and renewal.problem:
        refuse(f"the roles {renewal.prefix}_* were not granted what the upgrade added ({renewal.problem}): run "
               f"`ddiloco ledger roles --prefix {renewal.prefix}` as a role that may, before any learner writes")


@ledger_app.command("check")
def ledger_check(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run", help="Run id; defaults to the config's name."),
    ledger: str | None = LedgerOpt,
    store: str | None = StoreOpt,
) -> None:
    """Check a run's invariants against its store, read-only: prints "ok", or every problem and exits 1."""
    from ddiloco.platform.invariants import check_run

    with read_only_run(config, run, ledger, store) as ctx:
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

    url = ledger_url(ledger, config)
    try:
        backend = make_url(url).get_backend_name()
    except ArgumentError:
        refuse(f"not a ledger URL: {redact_url(url)}")
    if backend != "postgresql":
        refuse(f"ledger roles needs a PostgreSQL ledger: {backend} has no roles ({redact_url(url)})")
    pairs = []
    for item in logins:
        kind, eq, name = item.partition("=")
        if not eq:
            refuse(f"--login {item!r}: write KIND=NAME, e.g. dashboard=ops_dashboard")
        pairs.append((kind, name))
    try:
        plan = roles.RolePlan(prefix, tuple(dict.fromkeys(learners)), tuple(dict.fromkeys(pairs)))
    except ValueError as err:
        refuse(str(err))
    password = None
    if password_env is not None:
        password = os.environ.get(password_env)
        if not password:
            refuse(f"--password-env {password_env}: that environment variable is not set or is empty")
        if not plan.login_roles():
            refuse("--password-env sets the password of login roles: name them with --learner or --login")
    try:
        engine = create_engine(url, poolclass=NullPool)
    except (ImportError, NoSuchModuleError) as err:
        refuse(f"cannot open {redact_url(url)}: {err} (install the postgres extra)")
    try:
        with engine.begin() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
            head = ScriptDirectory.from_config(alembic_config()).get_current_head()
            if current != head:
                refuse(f"the ledger at {redact_url(url)} is at schema revision {current}, not {head}: run `ddiloco ledger upgrade` first")
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
            roles.apply(conn, plan)
    except (SQLAlchemyError, engine.dialect.loaded_dbapi.Error) as err:
        refuse(redact_url(f"ledger roles on {url} failed: {str(err).splitlines()[0]}"))
    finally:
        engine.dispose()
    typer.echo(f"roles {', '.join(plan.group(kind) for kind in roles.GROUPS)} set up on {redact_url(url)}")
    for kind, name in plan.login_roles():
        typer.echo(f"  login {name} in {plan.group(kind)}" + (" (password set)" if name in plan.passwords else ""))


# --- ddiloco run ---------------------------------------------------------------------------------------

RunArg = typer.Argument(..., help="The run's id (as `ddiloco runs` lists it).", show_default=False)
RUN_ENDS = {
    "finish": ("finished", "its synchronizer merges what is pending, then the run's processes exit"),
    "stop": ("stopped", "the run's processes exit at their next poll; nothing more is merged"),
}
"""``ddiloco run VERB``: the status it ends a run in, and what the run's processes do then."""


def end_run_by_hand(run: str, verb: str, ledger: str | None, config: Path | None) -> None:
    """End ``run`` as ``ddiloco run VERB`` says (:data:`RUN_ENDS`), and say so in one line; an unknown run, or one
    that ended otherwise already, is refused in one line (exit 2)."""
    import time

    from sqlalchemy.exc import SQLAlchemyError

    from ddiloco.platform.ledger import runs as runs_q
    from ddiloco.platform.ledger import session_factory
    from ddiloco.platform.runtime import to_datetime

    status, then = RUN_ENDS[verb]
    run_id = checked_id_or_exit(run, "run")
    url = plain(ledger_url(ledger, config))
    engine = existing_ledger(url, write=True)
    try:
        with session_factory(engine).begin() as s:
            if runs_q.get_run(s, run_id) is None:
                refuse(f"run {run_id!r} is not in the ledger at {redact_url(url)} (`ddiloco runs` lists its runs)")
            ended = runs_q.set_run_status(s, run_id, status, to_datetime(time.time()), detail=f"by hand: ddiloco run {verb}")
            row = runs_q.require_run(s, run_id)
            at = f"{row.finished_at:%Y-%m-%d %H:%M:%S} UTC" if row.finished_at else "an unknown time"
    except SQLAlchemyError as err:
        refuse(redact_url(f"cannot write the ledger at {url}: {str(err).splitlines()[0]}"))
    finally:
        engine.dispose()
    if ended:
        console.print(f"run {escape(run_id)} {status} at {at}: {then}", highlight=False, soft_wrap=True)
    elif row.status == status:
        console.print(f"run {escape(run_id)} had already {status} at {at}: nothing changed", highlight=False, soft_wrap=True)
    else:
        refuse(f"run {run_id} already ended as {row.status} at {at}: it stays {row.status}")


@run_app.command("finish")
def run_finish(run: str = RunArg, ledger: str | None = LedgerOpt, config: Path | None = ConfigOpt) -> None:
    """Finish a running run now, as its token budget would: pending work is merged, then every process exits."""
    end_run_by_hand(run, "finish", ledger, config)


@run_app.command("stop")
def run_stop(run: str = RunArg, ledger: str | None = LedgerOpt, config: Path | None = ConfigOpt) -> None:
    """Stop a running run now: every process of the run exits, and nothing more is merged."""
    end_run_by_hand(run, "stop", ledger, config)


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
    eos: str | None = typer.Option(None, "--eos", help="The token that ends every document (default: the tokenizer's own)."),
    shard_tokens: int = typer.Option(50_000_000, "--shard-tokens", min=1, help="Tokens per training shard."),
    val_fraction: float = typer.Option(0.01, "--val-fraction", help="Share of documents in the validation shard."),
    text_column: str = typer.Option("text", "--text-column", help="The text field of jsonl / parquet / datasets."),
    hf_split: str = typer.Option("train", "--hf-split"),
    fmt: str = typer.Option("bin", "--format", help="bin (flat uint16/uint32) or parquet (a token-list column)."),
    max_bytes: int | None = typer.Option(None, "--max-bytes", min=1, help="Cap on the text read (--input stdlib or site-packages only)."),
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
                corpus, out, tokenizer=tokenizer, train_tokenizer=train_tokenizer, eos=eos, shard_tokens=shard_tokens,
                val_fraction=val_fraction, fmt=fmt, progress=lambda docs, toks: bar.update(task, completed=docs, tokens=toks),
            )
    except ConfigError as err:
        refuse(str(err))
    console.print(
        f"{len(manifest.train)} training shard(s), {manifest.train_tokens:,} tokens; validation {manifest.val.tokens:,} tokens; "
        f"vocabulary {manifest.vocab_size} ({manifest.dtype}); manifest {out.rstrip('/')}/manifest.json"
    )
