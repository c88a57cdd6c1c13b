"""One entry per process: the learner, synchronizer and evaluator mains.

``ddiloco learner | synchronizer | evaluate``, the Prefect flows and the launchers' warm children all call these, so
every path refuses a bad id or config the same way, waits (bounded) for its ledger and store, and sets up logging the
same way. Bad input is refused before torch is imported: a process body is imported only once its checks pass.
Nothing here imports the CLI; the CLI's process commands are thin shells over :func:`main`."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ddiloco.platform.config import ConfigError, RunConfig, load_config, world_size_problem
from ddiloco.platform.ids import InvalidIdError, validate_id
from ddiloco.platform.memory import start_heap_trimmer
from ddiloco.platform.preflight import probe_ledger, probe_store
from ddiloco.platform.redact import RedactingFilter, one_line, redact_url

if TYPE_CHECKING:
    from ddiloco.learner_worker.launch import JobSummary

log = logging.getLogger("ddiloco.entry")

WAIT_S = 30.0
"""How long a process waits for its ledger and store before it gives up (bounded retries, one line each)."""


class EntryError(Exception):
    """Why a process main ends early, in one line, and its exit code: 2 for input or surroundings it refused, 1 for a
    learner job that failed."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def setup_logging(verbose: bool = False) -> None:
    """``ddiloco.*`` lines at INFO (DEBUG with ``verbose``) with credentials masked: on stderr, or through the handlers
    already in place (a Prefect flow run's: PREFECT_LOGGING_EXTRA_LOGGERS=ddiloco sends them to the run's logs too)."""
    level = logging.DEBUG if verbose else logging.INFO
    # A no-op where logging is configured already (Prefect, pytest): their handlers are kept.
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    logger = logging.getLogger("ddiloco")
    if verbose or logger.level == logging.NOTSET:
        logger.setLevel(level)
    for handler in [*logging.getLogger().handlers, *logger.handlers]:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def load(path: Path | None) -> RunConfig:
    """The run config at ``path`` (or the defaults) with the environment's overrides, or an EntryError naming the field."""
    try:
        return load_config(path)
    except ConfigError as err:
        raise EntryError(str(err)) from None


def checked_id(value: str, what: str) -> str:
    """``value`` when it is a safe id (it becomes part of store keys and ledger rows), else an EntryError saying why."""
    try:
        return validate_id(value, what)
    except InvalidIdError as err:
        raise EntryError(str(err)) from None


# --- reachability ------------------------------------------------------------------------------------


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


def wait_until_reachable(cfg: RunConfig, regions: list[str | None], wait_s: float) -> None:
    """The ledger (PostgreSQL) and the stores of ``regions`` answer, or an EntryError after ``wait_s``: bounded retries,
    a visible "waiting for …" line per failed attempt (the last one too), never a silent hang."""
    from tenacity import Retrying, stop_after_delay, wait_exponential

    targets = []
    ledger = cfg.ledger.url.get_secret_value()
    if ledger.startswith("postgresql"):
        targets.append(("ledger", ledger, probe_ledger(ledger)))
    options = cfg.storage.fsspec_options()
    for url in dict.fromkeys(cfg.storage_url_for(r) for r in regions):
        targets.append(("store", url, probe_store(url, options)))
    for what, url, probe in targets:
        shown = redact_url(url)

        def waiting(state: Any, what: str = what, shown: str = shown) -> None:
            log.warning("waiting for the %s at %s (attempt %s): %s", what, shown, state.attempt_number,
                        one_line(state.outcome.exception()))

        try:
            for attempt in Retrying(stop=stop_after_delay(wait_s), wait=wait_exponential(multiplier=0.5, max=5),
                                    after=waiting, reraise=True):
                with attempt:
                    _probe_within(probe, max(1.0, min(10.0, wait_s)))
        except Exception as err:  # noqa: BLE001 - whatever the client raised, it is one line
            raise EntryError(f"cannot reach the {what} at {shown} within {wait_s:g}s: {one_line(err)}") from None


# --- the process mains ----------------------------------------------------------------------------


def learner_main(
    cfg: RunConfig,
    learner_id: str,
    run_id: str | None = None,
    *,
    max_steps: int | None = None,
    nproc_per_node: int | None = None,
    summary_path: str | None = None,
    flow_run_url: str | None = None,
    wait_s: float = WAIT_S,
    verbose: bool = False,
) -> JobSummary | None:
    """One learner until the run ends (SIGTERM finishes its uploads and stops it); rank 0's summary (None on other
    ranks or when stopped by a signal). ``nproc_per_node`` defaults to the config's ``learners.nproc_per_node``."""
    setup_logging(verbose)
    run = checked_id(run_id or cfg.name, "run")
    checked_id(learner_id, "learner")
    nproc = nproc_per_node or cfg.learners.nproc_per_node
    try:
        _, region, _ = cfg.learners.resolve(learner_id)
        why = world_size_problem(nproc, cfg.learners.max_world_size)
        if why:
            raise ConfigError(f"learner {learner_id!r}: {why}")
    except ConfigError as err:
        raise EntryError(str(err)) from None
    wait_until_reachable(cfg, [region], wait_s)
    start_heap_trimmer()
    from ddiloco.learner_worker.launch import LearnerJobFailed, run_learner

    try:
        return run_learner(cfg, run, learner_id, max_steps=max_steps, nproc_per_node=nproc, summary_path=summary_path,
                           flow_run_url=flow_run_url)
    except ConfigError as err:
        raise EntryError(str(err)) from None
    except LearnerJobFailed as err:
        raise EntryError(str(err), code=1) from None


def synchronizer_main(
    cfg: RunConfig, run_id: str | None = None, label: str = "sync", *, shard: int | None = None, wait_s: float = WAIT_S,
    verbose: bool = False,
) -> None:
    """A synchronizer until stopped: active while it holds a shard's lease, else a hot standby; ``shard`` pins it."""
    setup_logging(verbose)
    run = checked_id(run_id or cfg.name, "run")
    checked_id(label, "synchronizer label")
    if shard is not None and not 0 <= shard < cfg.synchronizer.shards:
        raise EntryError(f"shard {shard}: the run has {cfg.synchronizer.shards} synchronizer shard(s), numbered from 0")
    wait_until_reachable(cfg, [None, *(r.name for r in cfg.learners.regions)], wait_s)
    start_heap_trimmer()
    from ddiloco.synchronizer.process import run_synchronizer

    try:
        run_synchronizer(cfg, run, label, shard=shard)
    except ConfigError as err:
        raise EntryError(str(err)) from None


def link_io_main() -> None:
    """A learner's link I/O process (``learners.link_process``), started by its learner: its spec (the run's config,
    its secrets masked, and the learner it serves) comes as a line on stdin, and it lives until stdin closes."""
    import json

    setup_logging()
    from ddiloco.learner_worker.linkio import serve

    serve(json.loads(sys.stdin.readline()))


def evaluator_main(
    cfg: RunConfig, run_id: str | None = None, *, device: str = "auto", wait_s: float = WAIT_S, verbose: bool = False
) -> int:
    """The run's evaluator until the run ends: evaluates new global versions on its cadence; the evaluations made."""
    setup_logging(verbose)
    run = checked_id(run_id or cfg.name, "run")
    wait_until_reachable(cfg, [None], wait_s)
    start_heap_trimmer()
    from ddiloco.platform.runtime import RunContext
    from ddiloco.synchronizer.evaluator import run_evaluator

    try:
        return run_evaluator(RunContext.open(cfg, run), device=device)
    except ValueError as err:
        raise EntryError(str(err)) from None


# --- a process as a launcher starts it ----------------------------------------------------------------

Role = Literal["learner", "synchronizer", "evaluator"]


@dataclass(frozen=True)
class ProcessSpec:
    """One of a run's processes: which main, with which options. The config file and the run id come from whoever
    starts it. A launcher runs it warm (a forked child calls :func:`main`) or cold (:meth:`argv`, a ``ddiloco`` command
    whose body calls :func:`main`)."""

    role: Role
    learner_id: str = ""
    max_steps: int | None = None
    nproc_per_node: int | None = None
    summary_path: str | None = None
    flow_run_url: str | None = None
    label: str = "sync"
    shard: int | None = None
    device: str = "auto"
    wait_s: float = WAIT_S
    verbose: bool = False

    @classmethod
    def learner(cls, learner_id: str, **options: Any) -> ProcessSpec:
        return cls("learner", learner_id=learner_id, **options)

    @classmethod
    def synchronizer(cls, label: str = "sync", **options: Any) -> ProcessSpec:
        return cls("synchronizer", label=label, **options)

    @classmethod
    def evaluator(cls, **options: Any) -> ProcessSpec:
        return cls("evaluator", **options)

    def argv(self, config: Path | str, run_id: str) -> list[str]:
        """The ``ddiloco`` command line that runs this process (the same options, spelled as the CLI spells them)."""
        # --run-id, not --run, for a learner: under torchrun, --run would be taken for its --run-path.
        common = ["--config", str(config), "--run-id" if self.role == "learner" else "--run", run_id]
        options: list[tuple[str, object]]
        if self.role == "learner":
            args = ["learner", "--learner", self.learner_id]
            options = [("--max-steps", self.max_steps), ("--nproc-per-node", self.nproc_per_node),
                       ("--summary-json", self.summary_path), ("--flow-run-url", self.flow_run_url)]
        elif self.role == "synchronizer":
            args, options = ["synchronizer", "--label", self.label], [("--shard", self.shard)]
        else:
            args, options = ["evaluate", "--device", self.device], []
        options.append(("--wait-s", None if self.wait_s == WAIT_S else f"{self.wait_s:g}"))
        args += common + [str(part) for flag, value in options if value is not None for part in (flag, value)]
        return args + (["--verbose"] if self.verbose else [])


def _call(spec: ProcessSpec, cfg: RunConfig, run_id: str | None) -> None:
    if spec.role == "learner":
        learner_main(cfg, spec.learner_id, run_id, max_steps=spec.max_steps, nproc_per_node=spec.nproc_per_node,
                     summary_path=spec.summary_path, flow_run_url=spec.flow_run_url, wait_s=spec.wait_s, verbose=spec.verbose)
    elif spec.role == "synchronizer":
        synchronizer_main(cfg, run_id, spec.label, shard=spec.shard, wait_s=spec.wait_s, verbose=spec.verbose)
    else:
        evaluator_main(cfg, run_id, device=spec.device, wait_s=spec.wait_s, verbose=spec.verbose)


def main(spec: ProcessSpec, config: Path | RunConfig | None, run_id: str | None = None) -> int:
    """A process's main, whoever starts it (its CLI command, a launcher's warm child): the exit code; when it refuses
    or its job fails, one line on stderr. ``config``: a config file (None: the defaults), or a config already loaded."""
    try:
        _call(spec, config if isinstance(config, RunConfig) else load(config), run_id)
    except EntryError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return err.code
    return 0
