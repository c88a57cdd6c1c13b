"""What a run will touch, checked before it starts (``ddiloco config``).

A check names one thing a run reads or writes (the shards, the tokenizer, the Hugging Face config,
the init_from weights, each store, the ledger) and a probe that reads it and says what it found, or
raises with what is wrong. Which checks a config needs (:func:`checks`), the notes about local paths
(:func:`local_path_notes`) and how outcomes read (:func:`report`) are pure; :func:`run_checks` is the
I/O shell: every probe runs in its own daemon thread, side by side, and one that has not answered
within its timeout is reported as such — an unreachable store or ledger costs seconds, never a hang."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.platform import stall
from ddiloco.platform.config import DataConfig, ModelConfig, RunConfig, sqlite_file_problem
from ddiloco.platform.redact import mask_tree, one_line, redact_url
from ddiloco.platform.units import plural

REACH_TIMEOUT_S = 10.0
"""How long a store or ledger may take to answer (a client's own retries can run for minutes)."""
READ_TIMEOUT_S = 60.0
"""How long reading the data's, the tokenizer's and the model's files may take (imports included)."""


@dataclass(frozen=True)
class Check:
    what: str
    """What is checked, as shown (URLs redacted), e.g. ``data.manifest s3://bucket/manifest.json``."""
    probe: Callable[[], str]
    """Reads it; returns what it found, or raises with what is wrong."""
    timeout_s: float


@dataclass(frozen=True)
class Outcome:
    what: str
    found: str | None = None
    problem: str | None = None


# ------------------------------------------------------------------------------------ probes


def _nearest_writable(path: Path) -> str:
    """Where a local file or folder that does not exist yet would be created, or why it could not."""
    import os

    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir():
        raise ValueError(f"{parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{parent} is not writable")
    return f"created on first use under {parent}"


def probe_store(url: str, options: dict[str, Any]) -> Callable[[], str]:
    """A store root answers: a local one can be created, a remote one's root or bucket exists."""

    def probe() -> str:
        from fsspec.core import url_to_fs
        from fsspec.implementations.local import LocalFileSystem
        from fsspec.implementations.memory import MemoryFileSystem

        fs, root = url_to_fs(url, **stall.store_options(url, options))
        if isinstance(fs, MemoryFileSystem):
            return "in this process's memory (a single-process run only)"
        if isinstance(fs, LocalFileSystem):
            path = Path(root)
            if path.exists():
                if not path.is_dir():
                    raise ValueError(f"{root} is not a directory")
                return "a local folder"
            return _nearest_writable(path)
        # A URL's user:secret@ part stays in the path fsspec hands back: never echo it (the line names the masked URL).
        bucket = root.strip("/").split("/", 1)[0]
        userinfo = bucket.rsplit("@", 1)[0] if "@" in bucket else None
        try:
            # Object-store clients answer exists() with False when they cannot reach the store at all.
            if not fs.exists(bucket):
                raise ValueError("its bucket does not exist or cannot be reached")
            return "reachable, the root exists" if fs.exists(root) else "reachable (the root is created by the first write)"
        except Exception as err:
            raise ValueError(str(err).replace(userinfo, "***") if userinfo else str(err)) from None

    return probe


def probe_ledger(url: str, timeout_s: float = REACH_TIMEOUT_S) -> Callable[[], str]:
    """The ledger answers: a SQLite file is a database or can be created, a server accepts a connection."""

    def probe() -> str:
        from sqlalchemy import create_engine, text
        from sqlalchemy.engine import make_url
        from sqlalchemy.pool import NullPool

        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite":
            if not parsed.database or parsed.database == ":memory:":
                return "in memory (a single-process run only)"
            path = Path(parsed.database)
            if not path.exists():
                return _nearest_writable(path)
            why = sqlite_file_problem(path)
            if why:
                raise ValueError(why)
            return "a SQLite database"
        engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": max(1, int(timeout_s))})
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        finally:
            engine.dispose()
        return "reachable"

    return probe


def _probe_tokenizer(data: DataConfig, model: ModelConfig) -> Callable[[], str]:
    def probe() -> str:
        from ddiloco.platform.tokenize import check_vocab, load_tokenizer

        assert data.tokenizer is not None
        tok = load_tokenizer(data.tokenizer, data.eos)
        check_vocab(model, data)
        if tok.eot_id is None:
            raise ValueError(f"data.tokenizer {data.tokenizer!r} names no end-of-text token, so documents would run together: "
                             "set data.eos to the token that ends a document")
        return f"vocabulary {tok.vocab_size:,}, documents end with {tok.eot!r}"

    return probe


def _probe_data(data: DataConfig, model: ModelConfig) -> Callable[[], str]:
    def probe() -> str:
        from ddiloco.platform.tokenize import check_vocab

        if data.source == "digits":
            return "built in (scikit-learn's 8x8 digits)"
        if data.source == "stdlib":
            check_vocab(model, data)
            return "built in (the standard library's .py files)"
        if data.source == "tokens":
            from ddiloco.platform.data import build_dataset

            ds: Any = build_dataset(data, model)  # what a learner opens: every shard's size, sampled ids, the vocabulary
            return (f"{plural(len(ds.train.shards), 'training shard')}, {ds.train.tokens:,} tokens; "
                    f"validation {ds.val.tokens:,} tokens")
        from ddiloco.platform.data.tokens import _expand

        if data.source == "glob":
            check_vocab(model, data)
            urls = _expand([data.glob or ""])
            if not urls:
                raise ValueError(f"data.glob {data.glob!r} matched no files")
            return plural(len(urls), "file")
        if data.source == "text":
            return _text_files(data.shards)
        assert data.hf_dataset is not None  # source hf
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(data.hf_dataset)
        if fs.exists(path):
            return "exists"
        if "://" in data.hf_dataset or data.hf_dataset.startswith((".", "/", "~")):
            raise ValueError(f"data.hf_dataset {data.hf_dataset!r} does not exist")
        return "not a path here: datasets.load_dataset resolves the name at run time (not checked)"

    return probe


def _text_files(patterns: list[str]) -> str:
    """data.source text: every file exists and can be read in ranges (not compressed); they are not scanned."""
    from fsspec.core import url_to_fs

    from ddiloco.platform.data.text import refuse_compressed
    from ddiloco.platform.data.tokens import _expand

    urls = _expand(patterns)
    if not urls:
        raise ValueError(f"data.shards {patterns} matched no files")
    total = 0
    for url in urls:
        refuse_compressed(url)
        fs, path = url_to_fs(url)
        try:
            total += fs.size(path)
        except FileNotFoundError:
            raise ValueError(f"text file {url!r} does not exist") from None
    return f"{plural(len(urls), 'file')}, {total:,} bytes"


def _probe_hf_config(model: ModelConfig) -> Callable[[], str]:
    def probe() -> str:
        from ddiloco.platform.models.hf import build_hf_config

        return f"a {build_hf_config(model).model_type} config that fits model.vocab_size and model.seq_len"

    return probe


def _probe_init_from(url: str) -> Callable[[], str]:
    def probe() -> str:
        from ddiloco.platform.models.weights import weight_files

        fs, files = weight_files(url, f"model.init_from {url}")
        size = sum(fs.size(f) for f in files)
        return f"{plural(len(files), 'safetensors file')}, {size:,} bytes"

    return probe


def _probe_import(path: str) -> Callable[[], str]:
    def probe() -> str:
        from ddiloco.platform.models import load_factory

        load_factory(path)
        return "imports, and names a callable"

    return probe


# ------------------------------------------------------------------------------------ plan


def checks(cfg: RunConfig, reach_timeout_s: float = REACH_TIMEOUT_S, read_timeout_s: float = READ_TIMEOUT_S) -> list[Check]:
    """Everything a run of ``cfg`` will touch, each with the probe that checks it (nothing is read here)."""
    data, model = cfg.data, cfg.model
    if data.source == "tokens":
        what = f"data.manifest {data.manifest}" if data.manifest else f"data.shards {data.shards}"
    else:
        what = f"data.source {data.source}" + {"glob": f" {data.glob}", "text": f" {data.shards}", "hf": f" {data.hf_dataset}"}.get(
            data.source, "")
    out = [Check(what, _probe_data(data, model), read_timeout_s)]
    if data.source in ("text", "hf"):
        out.append(Check(f"data.tokenizer {data.tokenizer}", _probe_tokenizer(data, model), read_timeout_s))
    if model.kind == "hf" and model.hf_path:
        out.append(Check(f"model.hf_path {model.hf_path}", _probe_hf_config(model), read_timeout_s))
    if model.kind == "import" and model.import_path:
        out.append(Check(f"model.import_path {model.import_path}", _probe_import(model.import_path), read_timeout_s))
    if model.init_from:
        out.append(Check(f"model.init_from {model.init_from}", _probe_init_from(model.init_from), read_timeout_s))
    options = cfg.storage.fsspec_options()
    for url in dict.fromkeys([cfg.storage.url, *(cfg.storage_url_for(r.name) for r in cfg.learners.regions)]):
        out.append(Check(f"store {url}", probe_store(url, options), reach_timeout_s))
    ledger = cfg.ledger.url.get_secret_value()
    out.append(Check(f"ledger {ledger}", probe_ledger(ledger, reach_timeout_s), reach_timeout_s))
    return [Check(redact_url(c.what), c.probe, c.timeout_s) for c in out]


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path_notes(cfg: RunConfig) -> list[str]:
    """Paths on this machine in a config whose ledger is a server (so its processes may run on other machines)."""
    if cfg.ledger.url.get_secret_value().startswith("sqlite"):
        return []
    data, model = cfg.data, cfg.model
    named: list[tuple[str, str | None]] = [
        ("model.hf_path", model.hf_path if model.kind == "hf" else None), ("model.init_from", model.init_from),
        ("data.tokenizer", data.tokenizer if data.source in ("text", "hf") else None),
        ("data.manifest", data.manifest if data.source == "tokens" else None),
        ("data.glob", data.glob if data.source == "glob" else None),
        ("data.hf_dataset", data.hf_dataset if data.source == "hf" else None),
        *(("data.shards", s) for s in (data.shards if data.source in ("tokens", "text") else [])),
        ("data.val_shard", data.val_shard if data.source == "tokens" else None), ("storage.url", cfg.storage.url),
        *((f"learners.regions[{r.name}].storage_url", r.storage_url) for r in cfg.learners.regions),
    ]
    return [f"{name} {value} is on this machine only: a process elsewhere (a pod) cannot read it unless it is mounted "
            "there; an s3:// or gs:// URL reaches every one"
            for name, value in named if value and _is_local(value)]


# ------------------------------------------------------------------------------------ I/O shell


def run_checks(planned: Iterable[Check], now: Callable[[], float] = time.monotonic) -> list[Outcome]:
    """Run every probe side by side, each in a daemon thread within its timeout; one outcome per check, in order."""
    planned = list(planned)
    results: list[list[Outcome]] = [[] for _ in planned]

    def run(i: int, c: Check) -> None:
        try:
            results[i].append(Outcome(c.what, found=c.probe()))
        except Exception as err:  # noqa: BLE001 - whatever the client raised, it is one line
            results[i].append(Outcome(c.what, problem=one_line(err, 300)))

    threads = [threading.Thread(target=run, args=(i, c), daemon=True, name=f"preflight-{i}") for i, c in enumerate(planned)]
    start = now()
    for t in threads:
        t.start()
    for t, c in zip(threads, planned, strict=True):
        t.join(max(0.0, start + c.timeout_s - now()))
    return [r[0] if r else Outcome(c.what, problem=f"no answer within {c.timeout_s:g}s")
            for r, c in zip(results, planned, strict=True)]


def report(outcomes: list[Outcome], notes: list[str]) -> tuple[list[str], bool]:
    """The lines ``ddiloco config`` prints (one per check, problems as ``error:``) and whether the run may start."""
    def line(o: Outcome) -> str:
        what = redact_url(o.what)  # each part on its own: a URL's masked query would take a ":" after it along
        if o.problem is None:
            return f"checked {what}: {redact_url(o.found or '')}"
        problem = redact_url(o.problem)
        return f"error: {problem}" if o.problem.startswith(o.what.split()[0]) else f"error: {what}: {problem}"

    lines = [line(o) for o in outcomes]
    lines += [f"note: {redact_url(n)}" for n in notes]
    problems = sum(o.problem is not None for o in outcomes)
    lines.append(f"{plural(len(outcomes), 'thing')} checked, " + (f"{plural(problems, 'problem')}" if problems else "no problem"))
    return lines, problems == 0


def preflight(cfg: RunConfig, offline: bool = False) -> tuple[list[str], bool]:
    """Check what a run of ``cfg`` will touch (nothing with ``offline``); the report's lines and whether all is well."""
    notes = local_path_notes(cfg)
    if offline:
        return [*(f"note: {redact_url(n)}" for n in notes),
                "--offline: nothing was read (data, tokenizer, model files, stores and ledger are unchecked)"], True
    return report(run_checks(checks(cfg)), notes)


def shown_config(cfg: RunConfig) -> dict[str, Any]:
    """The effective config as ``ddiloco config`` prints it: credentials masked, only the model fields its kind reads."""
    return mask_tree({**cfg.model_dump(mode="json"), "model": cfg.model.in_use()})
