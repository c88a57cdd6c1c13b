"""Ids are refused at registration when they could carry markup or escape a key prefix (SQLite and PostgreSQL)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from sqlalchemy import select
from ui_support import PHISH

from ddiloco.platform.ids import (
    InvalidIdError,
    global_key,
    key_problem,
    learner_state_key,
    outer_state_key,
    submission_key,
    validate_holder,
    validate_id,
)
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


@pytest.mark.parametrize("bad", ["NUL", "con", "Aux.txt", "lpt1.log", "us-0.", "a.b."])
def test_ids_that_name_a_device_or_another_name_on_some_os_are_refused(bad):
    with pytest.raises(InvalidIdError, match="not a valid id"):
        validate_id(bad, "learner")


@pytest.mark.parametrize("ok", ["us-0", "eu-12", "run.2026-01", "console", "nul-1", "com10", "a.b"])
def test_honest_ids_pass(ok):
    assert validate_id(ok, "learner") == ok


@pytest.mark.parametrize(
    "key, needle",
    [
        ("t/submissions/f0/us-1/u\x00.safetensors", "'\\x00'"),
        ("t/submissions/f0/us-1\\..\\..\\x.safetensors", "'\\\\'"),
        ("t/global/f0/C:/v0.safetensors", "':'"),
        ("t/global/f0/v0.safetensors:stream", "':'"),
        ("t/global/f0/\x1b[31mv0.safetensors", "'\\x1b'"),
        ("t/global/f0/v0 .safetensors", "' '"),
        ("t/global/f0/.tmp-4f2a", "prefix the store reserves"),
        (".tmp-4f2a", "prefix the store reserves"),
        ("t/learners/us-0/nul.safetensors", "device"),
        ("t/learners/us-0/state.", "device or another name"),
        ("t//global", "empty, '.' or '..'"),
        ("/etc/passwd", "empty, '.' or '..'"),
        ("t/../../x", "empty, '.' or '..'"),
        ("x" * 1025, "longer than 1024"),
    ],
)
def test_store_keys_that_name_what_they_should_not_are_refused_by_every_store_call(tmp_path, key, needle):
    import torch

    from ddiloco.platform.store import FragmentStore

    store = FragmentStore(f"file://{tmp_path}/store")
    assert key_problem(key) is not None and needle in key_problem(key), key_problem(key)
    for call in (lambda: store.put(key, {"w": torch.zeros(1)}), lambda: store.get(key), lambda: store.exists(key),
                 lambda: store.delete(key), lambda: store.delete_tree(key)):
        with pytest.raises(InvalidIdError, match="unsafe store key"):
            call()
    assert store.verify(key, "0" * 64) is False  # a check reports it as not intact, one line, no traceback
    assert list(tmp_path.joinpath("store").iterdir()) == []  # nothing was written anywhere


def test_every_key_the_platform_derives_passes_the_key_rule():
    keys = [global_key("r1", 3, 12), outer_state_key("r1", 0, 0), submission_key("r1", 2, "us-0", "a1b2c3"),
            learner_state_key("r1", "eu-1", "i2-s400"), global_key("r1", 0, 7).replace(".safetensors", "-3-0a1b2c3d.safetensors")]
    assert [key_problem(k) for k in keys] == [None] * len(keys)
