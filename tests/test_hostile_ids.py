"""Ids are refused at registration when they could carry markup or escape a key prefix (SQLite and PostgreSQL)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from sqlalchemy import select
from ui_support import PHISH

from ddiloco.platform.ids import InvalidIdError, validate_holder
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import open_ledger, session_factory
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import Run
from ddiloco.synchronizer.lease import holder_name

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
HOSTILE = [PHISH, "a b", "x" * 65, "../other", "run\n", "<b>", "", "ops@evil.example"]


def register_run(s, run_id: str) -> bool:
    return runs_q.create_run(s, run_id, config_json="{}", code_version="t", git_commit=None, num_fragments=1,
                        token_budget=1, now=NOW)


@pytest.mark.parametrize("bad", HOSTILE)
def test_hostile_ids_are_refused_and_nothing_is_written(ledger_url, bad):
    engine = open_ledger(ledger_url)
    try:
        with pytest.raises(InvalidIdError, match="not a valid id"), session_factory(engine).begin() as s:
            register_run(s, bad)
        with session_factory(engine).begin() as s:
            assert register_run(s, "r1")
        with pytest.raises(InvalidIdError, match="learner"), session_factory(engine).begin() as s:
            learner_q.register_learner(s, "r1", bad, "us", NOW)
        with pytest.raises(InvalidIdError, match="region"), session_factory(engine).begin() as s:
            learner_q.register_learner(s, "r1", "us-0", bad, NOW)
        if bad not in ("ops@evil.example", "x" * 65):  # a holder may be label@host, up to 128 characters
            with pytest.raises(InvalidIdError, match="holder"), session_factory(engine).begin() as s:
                sync_q.acquire_lease(s, "r1", bad, 5.0, NOW)
        with session_factory(engine)() as s:
            assert s.scalars(select(Run.id)).all() == ["r1"]
            assert runs_q.learners(s, "r1") == []
    finally:
        engine.dispose()


def test_real_holder_names_are_valid():
    assert validate_holder(holder_name("sync")) and validate_holder("sync-inprocess")
    with pytest.raises(InvalidIdError):
        validate_holder(f"sync@{PHISH}")
