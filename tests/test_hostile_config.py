"""Config that refuses nonsense: each bad input is one ConfigError line naming the file or the field, fast."""

from __future__ import annotations

import os
import time

import pytest

from ddiloco.platform.config import (
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_NODES,
    ConfigError,
    build_config,
    ledger_url_problem,
    load_config,
    store_url_problem,
    unknown_env,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("DDILOCO_"):
            monkeypatch.delenv(key)


def refused(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        build_config(data)
    return str(err.value)


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"outer": {"lr": float("inf")}}, "outer.lr: Input should be a finite number"),
        ({"outer": {"lr": float("nan")}}, "outer.lr: Input should be a finite number"),
        ({"outer": {"lr": 1e308}}, "outer.lr: Input should be less than or equal to 10"),
        ({"outer": {"lr": True}}, "outer.lr: expected a number, got a boolean"),
        ({"learners": {"batch_size": True}}, "learners.batch_size: expected a number, got a boolean"),
        ({"synchronizer": {"lease_ttl_s": float("inf")}}, "synchronizer.lease_ttl_s: Input should be a finite number"),
        ({"synchronizer": {"lease_ttl_s": 1e12}}, "synchronizer.lease_ttl_s: Input should be less than or equal to"),
        ({"merge": {"norm_outlier_factor": float("inf")}}, "merge.norm_outlier_factor: Input should be a finite number"),
        ({"seed": 1e23}, "seed:"),
        ({"seed": -1}, "seed: Input should be greater than or equal to 0"),
        ({"chaos": {"seed": 2**64}}, "chaos.seed:"),
        ({"quorum": {"min_count": 1000}}, "quorum.min_count (1000) exceeds the 4 learners"),
        ({"learners": {"regions": [{"name": "us", "learners": 0}]}}, "at least one learner"),
        ({"learners": {"heartbeat_s": 2.0, "dead_after_s": 1.0}}, "learners.dead_after_s (1.0) must exceed learners.heartbeat_s"),
        ({"synchronizer": {"poll_s": 5.0, "lease_ttl_s": 3.0}}, "synchronizer.lease_ttl_s (3.0) must exceed synchronizer.poll_s"),
        ({"storage": {"url": "nosuchproto://bucket/x"}}, "storage.url: unknown store protocol 'nosuchproto'"),
        ({"learners": {"regions": [{"name": "us", "storage_url": "nosuchproto://b"}]}}, "learners.regions.us.storage_url"),
        ({"ledger": {"url": "http://db.example/ledger"}}, "ledger.url: unsupported ledger backend 'http'"),
        ({"ledger": {"url": "/etc/hostname"}}, "ledger.url: not a database URL"),
        ({"ledger": {"url": "ops:hunter2@db/ledger"}}, "ledger.url: not a database URL: use"),
        ({"ledger": {"url": "postgresql+nosuchdriver://db/x"}}, "ledger.url: unsupported driver 'nosuchdriver'"),
        ({"ledger": {"url": "postgresql+psycopg://u@h/db", "idle_in_transaction_timeout_s": 30.0}},
         "ledger.idle_in_transaction_timeout_s (30.0) must not exceed learners.dead_after_s"),
    ],
)
def test_nonsense_is_refused_naming_the_field(data, needle):
    message = refused(data)
    assert needle in message and "hunter2" not in message, message


def test_a_sqlite_path_that_is_a_directory_is_refused(tmp_path):
    assert "is a directory" in refused({"ledger": {"url": f"sqlite:///{tmp_path}"}})
    assert ledger_url_problem(f"sqlite:///{tmp_path}/ledger.db") is None


@pytest.mark.parametrize("url", ["sqlite:///./x.db", "sqlite://", "postgresql+psycopg://u@h/db", "sqlite+pysqlite:///x.db"])
def test_usable_ledger_urls_pass(url):
    assert ledger_url_problem(url) is None


@pytest.mark.parametrize("url", ["file://./store", "./store", "memory://x", "s3://bucket/x", "simplecache::s3://bucket/x"])
def test_installed_store_protocols_pass(url):
    assert store_url_problem(url) is None


def write(tmp_path, name: str, content: str | bytes):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


# A 9-level "billion laughs": ~535 bytes that expand to 9^9 values.
ALIAS_BOMB = "model:\n  kwargs:\n    a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 9)
)


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("bomb.yaml", ALIAS_BOMB, "values once its aliases are expanded"),
        ("self.yaml", "model:\n  kwargs:\n    a: &a [1, *a]\n", "an alias refers to itself"),
        ("dup.yaml", "outer:\n  lr: 0.5\n  lr: 0.7\n", "line 3: key 'lr' appears twice"),
        ("dup-top.yaml", "name: a\nseed: 1\nname: b\n", "key 'name' appears twice"),
        ("intkey.yaml", "model:\n  kwargs:\n    1: x\n", "line 3: key 1 is not a string"),
        ("boolkey.yaml", "model:\n  kwargs:\n    on: x\n", "key True is not a string"),
        ("deep.yaml", "model:\n  kwargs:\n    a: " + "[" * 20000 + "]" * 20000 + "\n", f"nested deeper than {MAX_CONFIG_DEPTH}"),
        ("deep.json", "[" * 20000 + "]" * 20000, f"nested deeper than {MAX_CONFIG_DEPTH}"),
        ("deep.toml", "a = " + "[" * 20000 + "]" * 20000 + "\n", "nested too deep"),
        ("latin1.yaml", "name: caf\xe9\n".encode("latin-1"), "is not UTF-8 text"),
        ("broken.yaml", "outer: [1,\n", "does not parse"),
        ("broken-url.yaml", "ledger:\n  url: postgresql://ops:hunter2@db/x bad: 1\n", "does not parse"),  # quoted by the parser
        ("list.yaml", "- 1\n- 2\n", "must hold a mapping"),
        ("config.ini", "[x]\n", "must end in"),
        ("huge.yaml", "# " + "x" * (1 << 20) + "\n", "larger than"),
    ],
)
def test_bad_files_are_one_line_naming_the_file(tmp_path, name, content, needle):
    path = write(tmp_path, name, content)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert needle in message and str(path) in message and "\n" not in message and "hunter2" not in message, message
    assert time.perf_counter() - start < 5.0  # ms when idle; generous for a loaded machine


def test_the_alias_bomb_is_small_and_anchors_within_bounds_still_work(tmp_path):
    assert len(ALIAS_BOMB) < 600
    shared = "model:\n  kind: import\n  import_path: m:f\n  kwargs:\n    a: &dims [4, 8]\n    b: *dims\n"
    assert load_config(write(tmp_path, "ok.yaml", shared)).model.kwargs == {"a": [4, 8], "b": [4, 8]}


def test_unknown_env_variables_and_single_underscore_typos_are_refused(monkeypatch):
    monkeypatch.setenv("DDILOCO_OUTER_LR", "99")
    message = refused({})
    assert "DDILOCO_OUTER_LR overrides no config field" in message and "DDILOCO_OUTER__LR" in message
    monkeypatch.delenv("DDILOCO_OUTER_LR")
    monkeypatch.setenv("DDILOCO_OUTER__LRR", "0.5")
    assert "DDILOCO_OUTER__LRR overrides no config field" in refused({})
    monkeypatch.delenv("DDILOCO_OUTER__LRR")
    monkeypatch.setenv("DDILOCO_OUTER__LR", "0.25")
    monkeypatch.setenv("DDILOCO_LEDGER_URL", "sqlite:///x.db")  # the dashboard's own variable
    assert build_config({}).outer.lr == 0.25


def test_unknown_env_walks_sections():
    assert unknown_env({"DDILOCO_LEARNERS__REGIONS": "[]", "DDILOCO_GRACE__MAX_S": "1", "PATH": "/bin"}) == []
    assert unknown_env({"DDILOCO_STORAGE__SECRETS__KEY": "k", "DDILOCO_MODEL__KWARGS__DIM": "8",
                        "DDILOCO_MODEL__HF_CONFIG__MODEL_TYPE": "llama"}) == []
    assert len(unknown_env({"DDILOCO_GRACE__MAX_S__X": "1", "ddiloco_seedd": "1"})) == 2


def test_a_broken_json_env_override_is_one_line(monkeypatch):
    monkeypatch.setenv("DDILOCO_LEARNERS__REGIONS", "[{bad")
    message = refused({})
    assert "learners" in message and "\n" not in message, message


TOML_HEAD = "[model]\nkind = 'import'\nimport_path = 'm:f'\n[model.kwargs]\n"


@pytest.mark.parametrize(
    "name, content, needle",
    [
        # TOML and JSON nest and grow without the brackets and aliases the YAML pre-check counts.
        ("dotted.toml", TOML_HEAD + ".".join(["a"] * 5000) + " = 1\n", f"nested deeper than {MAX_CONFIG_DEPTH} levels"),
        ("wide.toml", TOML_HEAD + "a = [" + ",".join(["1"] * 70_000) + "]\n", "larger than"),
        ("wide.json", '{"model": {"kwargs": {"a": [' + ",".join(["1"] * 70_000) + "]}}}", "larger than"),
        # Under the old 1 MB limit, seconds of PyYAML's time a load.
        ("slow.yaml", "model:\n  kwargs:\n    a: [" + ", ".join(["1"] * 50_000) + "]\n", "larger than"),
    ],
)
def test_configs_too_big_or_deep_in_any_format_are_one_line(tmp_path, name, content, needle):
    path = write(tmp_path, name, content)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert needle in message and str(path) in message and "\n" not in message, message
    assert time.perf_counter() - start < 5.0


def test_a_config_built_in_code_is_bounded_too():
    deep: dict = {}
    for _ in range(2000):
        deep = {"a": deep}
    assert f"nested deeper than {MAX_CONFIG_DEPTH}" in refused({"model": {"kind": "import", "import_path": "m:f", "kwargs": deep}})
    wide = {"model": {"kind": "import", "import_path": "m:f", "kwargs": {"a": [1] * (MAX_CONFIG_NODES + 1)}}}
    assert f"more than {MAX_CONFIG_NODES} values" in refused(wide)


@pytest.mark.parametrize("content", [b"hello, not a database\n", b"\x00" * 4096, b"PK\x03\x04 a zip file"])
def test_a_ledger_url_naming_a_file_that_is_not_a_database_is_one_line_at_load_and_at_the_engine(tmp_path, content):
    from ddiloco.platform.ledger import open_ledger

    path = tmp_path / "notes.db"
    path.write_bytes(content)
    url = f"sqlite:///{path}"
    assert f"ledger.url: the SQLite path {path} is not a SQLite database" in refused({"ledger": {"url": url}})
    with pytest.raises(ConfigError, match="is not a SQLite database"):
        open_ledger(url)  # a --ledger option, the dashboard, a flow: no config was loaded
    assert path.read_bytes() == content  # untouched: not turned into a database, not switched to WAL


def test_empty_and_real_sqlite_files_are_ledgers(tmp_path):
    from ddiloco.platform.ledger import open_ledger

    (tmp_path / "empty.db").touch()
    for url in (f"sqlite:///{tmp_path}/empty.db", f"sqlite:///{tmp_path}/new.db"):
        assert ledger_url_problem(url) is None
        open_ledger(url).dispose()
    assert ledger_url_problem(f"sqlite:///{tmp_path}/new.db") is None  # now a database, still usable


def test_more_fragments_than_the_model_has_pieces_is_a_config_error():
    from ddiloco.platform.fragments import partition

    with pytest.raises(ConfigError, match=r"fragments.count \(5\) exceeds the number of parameter tensors \(4"):
        partition([("a", (2, 3), 4), ("b", (3,), 4), ("c", (1,), 4)], 5)
