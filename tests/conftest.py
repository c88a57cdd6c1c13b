"""Shared fixtures: ledgers on SQLite and PostgreSQL, fragment stores on file://, memory:// and s3:// (moto).

Fixture names are a contract other test files rely on: ``postgres_url``, ``ledger_url``,
``s3_endpoint``, ``store_url``. The scaffolding itself lives in ``ddiloco.testing``.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

# Every xdist worker imports every test module. Where PYTHONDONTWRITEBYTECODE is set (as on CI's machines) pytest would
# rewrite all of them anew in every worker at every run (~4 s of CPU a worker); cache the rewritten modules instead (a
# fresh clone's first run still rewrites them). The suite's child processes keep the setting; the project's own
# bytecode is compiled at install (infra/install.sh).
sys.dont_write_bytecode = False

# Set before anything imports prefect / streamlit: no telemetry from test runs.
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ["STREAMLIT_BROWSER_GATHER_USAGE_STATS"] = "false"

# --- PostgreSQL -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_url():
    """A PostgreSQL server URL: $DDILOCO_TEST_POSTGRES_URL, the local server, or a throwaway cluster."""
    from ddiloco.testing import postgres

    url = postgres.server_url()
    reason = postgres.unreachable(url)
    if reason is None:
        yield url
        return
    reasons = [f"{url}: {reason}"]
    if not os.environ.get(postgres.SERVER_URL_ENV):
        try:
            cluster = postgres.ThrowawayCluster.start()
        except RuntimeError as err:
            reasons.append(str(err))
        else:
            try:
                yield cluster.url
            finally:
                cluster.stop()
            return
    message = "!!! PostgreSQL tests NOT RUN — no usable server: " + " | ".join(reasons)
    if os.environ.get("DDILOCO_REQUIRE_POSTGRES") == "1":
        pytest.fail(message + " (DDILOCO_REQUIRE_POSTGRES=1)", pytrace=False)
    pytest.skip(message)


@pytest.fixture
def fresh_postgres_database(postgres_url):
    """A uniquely named, empty database on the postgres_url server, dropped after the test."""
    from ddiloco.testing.postgres import scratch_database

    with scratch_database(postgres_url) as url:
        yield url


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
    ids=["sqlite", "postgres"],
)
def ledger_url(request, tmp_path):
    """An empty ledger URL of each backend; nothing is shared between tests."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/ledger.db"
    return request.getfixturevalue("fresh_postgres_database")


# --- object stores ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_endpoint():
    """An in-process moto S3 server; the AWS_* env points plain s3fs / boto clients (and subprocesses) at it."""
    from ddiloco.platform.config import environment
    from ddiloco.testing.s3 import S3Server

    with S3Server() as server, environment(server.env()):
        yield server.url


@pytest.fixture(params=["file", "memory", "s3"])
def store_url(request, tmp_path):
    """A fresh, empty fragment-store root URL of each kind."""
    if request.param == "file":
        return f"file://{tmp_path}/store"
    if request.param == "memory":
        return f"memory://t-{uuid.uuid4().hex}"
    request.getfixturevalue("s3_endpoint")
    import s3fs

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}/root"


# --- collection -------------------------------------------------------------------------------------


LONGEST_FIRST = (
    "test_quality_smoke", "test_chaos_suite", "test_export", "test_chaos_soak", "test_benchmarks_smoke", "test_ddp_learner",
    "test_fsdp_learner", "test_prefect_integration", "test_data_prepare", "test_compact_downloads", "test_infra",
    "test_learner_state", "test_flows",
)
"""Modules that take minutes (their summed test times, longest first): under xdist (``--dist loadscope``, a module
to a worker, see pyproject) they start first, so that none of them starts last and holds up the run's end."""


def pytest_collection_modifyitems(config, items):
    # Any test parametrised with a "postgres" id needs the server, whichever fixture put it there.
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "postgres" in callspec.id.split("-"):
            item.add_marker(pytest.mark.postgres)

    def rank(item) -> int:
        stem = Path(item.nodeid.split("::", 1)[0]).stem
        return LONGEST_FIRST.index(stem) if stem in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within each rank is the collection order
