"""Planted secrets (a ledger password, store credentials) never leave the process that holds them:
not in `ddiloco config`, not in a saved config, not in any ledger row, not in any process log of a run,
and they still reach the ledger and the store. (Job variables of deployments: test_prefect_integration.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import MetaData, select
from sqlalchemy.engine import make_url
from support import tiny_config

from ddiloco.flows.runner import train_locally
from ddiloco.platform.ledger import make_engine
from ddiloco.platform.runtime import RunContext

PASSWORD = "pw-planted-7f3a9c"
STORE_KEY = "AKIAPLANTED0000KEY"
STORE_SECRET = "store-secret-planted-91d2"
PLANTED = (PASSWORD, STORE_KEY, STORE_SECRET)


def leaks(text: str) -> list[str]:
    return [p for p in PLANTED if p in text]


def with_password(url: str) -> str:
    # The local server trusts every connection: the password is carried, ignored, and must not leak.
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def test_config_command_masks_the_ledger_password_and_store_secrets(tmp_path):
    env = {"DDILOCO_LEDGER__URL": f"postgresql+psycopg://ddiloco:{PASSWORD}@db.internal:5432/ddiloco",
           "DDILOCO_STORAGE__SECRETS__KEY": STORE_KEY, "DDILOCO_STORAGE__SECRETS__SECRET": STORE_SECRET}
    out = subprocess.run([sys.executable, "-m", "ddiloco", "config"], env={**os.environ, **env}, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr  # db.internal cannot be reached from here, and the check says so
    shown = json.loads(out.stdout)
    assert not leaks(out.stdout + out.stderr)
    assert "error: ledger postgresql+psycopg://ddiloco:***@db.internal:5432/ddiloco" in out.stderr, out.stderr
    assert shown["ledger"]["url"] == "postgresql+psycopg://ddiloco:***@db.internal:5432/ddiloco"
    assert set(shown["storage"]["secrets"]) == {"key", "secret"}


@pytest.mark.postgres
def test_a_short_run_keeps_planted_secrets_out_of_rows_logs_and_files(fresh_postgres_database, s3_endpoint, tmp_path, capfd):
    cfg = tiny_config(
        name="secrets",
        token_budget=3 * 4 * 32 * 8,
        learners={"regions": [{"name": "us", "learners": 1}], "heartbeat_s": 0.5, "poll_s": 0.2},
        synchronizer={"poll_s": 0.1, "lease_ttl_s": 1.5, "eval_every_s": 1.0},
        ledger={"url": with_password(fresh_postgres_database)},
        storage={"url": "s3://ddiloco-secrets/run", "storage_options": {"client_kwargs": {"endpoint_url": s3_endpoint}},
                 "secrets": {"key": STORE_KEY, "secret": STORE_SECRET}},
    )
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).mkdir("ddiloco-secrets")
    # The store is opened with the configured credentials (moto accepts any).
    fs = RunContext.open(cfg, "secrets").store().fs
    assert (fs.key, fs.secret) == (STORE_KEY, STORE_SECRET)

    summary = train_locally(cfg, "secrets", workdir=str(tmp_path / "runs"))
    assert summary["tokens"] >= cfg.token_budget and sum(summary["versions"].values()) > 0

    engine = make_engine(fresh_postgres_database)
    meta = MetaData()
    meta.reflect(engine)
    rows = 0
    with engine.connect() as conn:
        for table in meta.sorted_tables:
            for row in conn.execute(select(table)):
                rows += 1
                assert not leaks(repr(tuple(row))), f"a {table.name} row holds a planted secret"
    assert rows > 10
    files = [p for p in Path(tmp_path / "runs").rglob("*") if p.is_file()]
    assert any(p.suffix == ".log" for p in files) and any(p.name == "config.yaml" for p in files)
    for path in files:
        assert not leaks(path.read_text(errors="replace")), f"{path.name} holds a planted secret"
    captured = capfd.readouterr()
    assert not leaks(captured.out + captured.err)


def test_deploy_refuses_credentials_in_storage_options_and_passwords_in_store_urls():
    from ddiloco.flows.deploy import parse_secret_blocks, region_env

    leaky = tiny_config(storage={"url": "s3://b/run", "storage_options": {"client_kwargs": {"aws_secret_access_key": STORE_SECRET}}})
    with pytest.raises(ValueError, match="aws_secret_access_key: put store credentials in storage.secrets"):
        region_env(leaky, "us")
    with pytest.raises(ValueError, match="storage.url carries a password"):
        region_env(tiny_config(storage={"url": f"s3://user:{PASSWORD}@b/run"}), "us")
    cfg = tiny_config(storage={"url": "s3://b/run", "secrets": {"secret": STORE_SECRET}})
    ok = region_env(cfg, "us", {"DDILOCO_LEDGER__URL": "db-url"})
    assert not leaks(json.dumps(ok)) and ok["DDILOCO_LEDGER__URL"] == "{{ prefect.blocks.secret.db-url }}"
    for bad in ("DDILOCO_LEDGER__URL", "lower=block", "DDILOCO_X=Bad_Block", "=x"):
        with pytest.raises(ValueError, match="expected ENV_VAR=block-name"):
            parse_secret_blocks([bad])


def test_a_store_secret_name_the_environment_cannot_carry_is_refused_naming_it(tmp_path, monkeypatch):
    """Secrets reach a run's processes as DDILOCO_STORAGE__SECRETS__<NAME>, read back lower-cased and split at '__':
    a name that comes back as another key would leave the child with the saved mask under the name it was given."""
    from ddiloco.platform.config import ConfigError, build_config, load_config, secret_env
    from ddiloco.testing.processes import write_config

    for name in [k for k in os.environ if k.startswith("DDILOCO_")]:
        monkeypatch.delenv(name)
    for bad in ("accountKey", "KEY", "sas__token", "account-key", "_key", ""):
        with pytest.raises(ConfigError, match=rf"^invalid configuration:\n  storage.secrets: secret name {bad!r} cannot travel as an "
                                              r"environment variable to the run's processes: use lower-case") as err:
            build_config({"storage": {"secrets": {bad: STORE_SECRET}}})
        assert not leaks(str(err.value))
    # Every name it accepts arrives in a child as the key it was given.
    good = {"key": STORE_KEY, "secret": STORE_SECRET, "account_key": STORE_KEY, "sas_token": STORE_SECRET, "v2_token": PASSWORD}
    cfg = tiny_config(ledger={"url": f"sqlite:///{tmp_path / 'ledger.db'}"},
                      storage={"url": f"file://{tmp_path / 'store'}", "secrets": good})
    saved = write_config(cfg, tmp_path / "config.yaml")
    for name, value in secret_env(cfg).items():
        monkeypatch.setenv(name, value)
    assert load_config(saved).storage.fsspec_options() == good


def test_a_saved_config_without_its_secrets_is_refused_and_the_environment_restores_them(tmp_path, monkeypatch):
    """A saved config holds its secrets masked; loaded without the environment that gives them, the ledger and the
    store would be opened with the masks for passwords: refused in one line naming the field and the variable."""
    from ddiloco.platform.config import ConfigError, load_config, secret_env
    from ddiloco.testing.processes import write_config

    for name in [k for k in os.environ if k.startswith("DDILOCO_")]:
        monkeypatch.delenv(name)
    cfg = tiny_config(ledger={"url": f"sqlite:///{tmp_path / 'ledger.db'}"},
                      storage={"url": f"file://{tmp_path / 'store'}", "secrets": {"key": STORE_KEY}})
    saved = write_config(cfg, tmp_path / "config.yaml")
    assert not leaks(saved.read_text())
    with pytest.raises(ConfigError, match=r"^storage.secrets.key holds the mask .*DDILOCO_STORAGE__SECRETS__KEY\)$") as err:
        RunContext.open(load_config(saved))
    assert not leaks(str(err.value))
    for name, value in secret_env(cfg).items():
        monkeypatch.setenv(name, value)
    assert RunContext.open(load_config(saved)).cfg.storage.fsspec_options() == {"key": STORE_KEY}

    for name in secret_env(cfg):
        monkeypatch.delenv(name)
    pg = tiny_config(ledger={"url": f"postgresql+psycopg://ddiloco:{PASSWORD}@db.internal:5432/ddiloco"})
    write_config(pg, saved)
    with pytest.raises(ConfigError, match=r"^ledger.url holds the mask '\*\*\*' in place of its password .*DDILOCO_LEDGER__URL\)$"):
        RunContext.open(load_config(saved))
