"""One rule masks a URL's password, whatever the URL: ledger, store bucket or region."""

from __future__ import annotations

import io
import logging
from urllib.parse import quote

import pytest

from ddiloco.platform.config import build_config
from ddiloco.platform.redact import MASK, RedactingFilter, is_sensitive, mask_tree, redact_url

RESERVED = "p@ss:w/rd?#%&="


@pytest.mark.parametrize(
    "url, secret, shown",
    [
        # A password in the userinfo.
        ("postgresql+psycopg://ops:s3cret@db.internal:5432/ledger", "s3cret", f"postgresql+psycopg://ops:{MASK}@db.internal:5432/"),
        # A password with reserved characters, percent-encoded as a URL requires.
        (f"postgresql://ops:{quote(RESERVED, safe='')}@db/ledger", "p%40ss", f"postgresql://ops:{MASK}@db/ledger"),
        # libpq's ?password= query parameter; the other parameters stay.
        ("postgresql+psycopg://ops@db/ledger?sslmode=require&password=s3cret", "s3cret", "postgresql+psycopg://ops@db/ledger?"),
        # An object store's secret key in the userinfo (AWS secret keys hold '/' and '+').
        ("s3://AKIAEXAMPLE:wJalr/XUtn+FEMI@bucket/prefix", "wJalr", f"s3://AKIAEXAMPLE:{MASK}@bucket/prefix"),
    ],
)
def test_the_password_is_masked_and_the_rest_shown(url, secret, shown):
    masked = redact_url(url)
    assert secret not in masked
    assert masked.startswith(shown)
    if "?" in url:
        assert "sslmode=require" in masked and "password=" in masked


def test_no_part_of_a_password_with_reserved_characters_is_shown():
    masked = redact_url(f"postgresql://ops:{quote(RESERVED, safe='')}@db/ledger")
    assert not any(part in masked for part in ("p%40", "ss", "w%2F", "rd"))


@pytest.mark.parametrize(
    "text",
    [
        "sqlite:///./ddiloco-runs/ledger.db",
        "postgresql+psycopg://ops@db/ledger?sslmode=require",
        "s3://bucket/a/**/*.py",
        "memory://x",
        "gpt",
        "pkg.mod:factory",
        "ops@example.com",
        "git@github.com:org/repo.git",
        "at 10:03 ops@example.com wrote",
    ],
)
def test_text_without_a_password_is_kept_exactly(text):
    assert redact_url(text) == text


@pytest.mark.parametrize(
    "text, secret, kept",
    [
        # Unencoded '@' and '/' in the password: SQLAlchemy's parser would show "ss/w@rd" as host and database.
        ("postgresql://ops:p@ss/w@rd@db/ledger", ("p@ss", "ss/w", "w@rd"), "postgresql://ops:***@db/ledger"),
        ("postgresql://ops:pa?ss@db/x?sslmode=require", ("pa?ss", "pa"), "@db/x?sslmode=require"),
        # libpq options, raw or percent-encoded, carrying a password.
        ("postgresql://ops@db/ledger?options=-c%20password%3Dhunter2", ("hunter2",), "postgresql://ops@db/ledger?options="),
        ("postgresql://ops@db/ledger?options=password=hunter2&sslmode=require", ("hunter2",), "sslmode=require"),
        # A libpq keyword/value conninfo string, quoted values included.
        ("host=db user=ops password=hunter2 dbname=ledger", ("hunter2",), "host=db user=ops password=*** dbname=ledger"),
        ("host=db password='a b c' dbname=ledger", ("a b", "b c"), "dbname=ledger"),
        # Object stores: credentials as query parameters.
        ("s3://bucket/store?secret=wJalrXUtn&key=AKIAEXAMPLE", ("wJalrXUtn", "AKIAEXAMPLE"), "s3://bucket/store?secret=***"),
        ("gs://bucket/store?token=ya29.secret", ("ya29",), "gs://bucket/store?token=***"),
        ("https://acct.blob.core.windows.net/c?sv=2020&sig=abc%2Fdef", ("abc",), "sv=2020"),
        ("https://b.s3.amazonaws.com/k?X-Amz-Signature=deadbeef&X-Amz-Security-Token=tok1", ("deadbeef", "tok1"), "X-Amz-Signature=***"),
        # A port that does not parse is still a URL with a password.
        ("s3://key:secret@bucket:notaport/x", ("secret",), "s3://key:***@bucket:notaport/x"),
        # A URL inside a message (a driver's error quoting the URL it could not parse).
        ("could not parse 'postgresql://u:hunter2@h/db'", ("hunter2",), "could not parse 'postgresql://u:***@h/db'"),
        # The userinfo without its scheme, as botocore quotes what it took for a bucket name.
        ('Invalid bucket name "KEYID:s3cr3t@bucket": Bucket name must match', ("s3cr3t",), 'name "KEYID:***@bucket"'),
        ("ops:p@ss/w@rd@db.internal refused", ("p@ss", "ss/w", "w@rd"), "ops:***@db.internal refused"),
        # Several hosts with ports.
        ("postgresql://u:hunter2@h1:5432,h2:5433/db", ("hunter2",), "@h1:5432,h2:5433/db"),
    ],
)
def test_every_credential_shape_is_masked(text, secret, kept):
    masked = redact_url(text)
    assert not any(part in masked for part in secret), masked
    assert kept in masked and MASK in masked


@pytest.mark.parametrize(
    "name", ["password", "sslpassword", "aws_secret_access_key", "X-Amz-Security-Token", "sig", "apiKey", "Credential"]
)
def test_sensitive_names(name):
    assert is_sensitive(name)


@pytest.mark.parametrize("name", ["tokenizer", "access_key_id", "sslmode", "user", "block_tokens", "keep_last"])
def test_ordinary_names(name):
    assert not is_sensitive(name)


def test_credentials_given_as_options_are_masked_in_a_tree():
    tree = {"storage_options": {"key": "AKIA", "secret": "wJalr", "endpoint_url": "http://minio:9000"}, "tokenizer": "gpt2"}
    assert mask_tree(tree) == {"storage_options": {"key": MASK, "secret": MASK, "endpoint_url": "http://minio:9000"}, "tokenizer": "gpt2"}


def test_the_recorded_config_masks_every_url():
    cfg = build_config(
        {
            "ledger": {"url": "postgresql+psycopg://ops:s3cret@db/ledger"},
            "storage": {"url": "s3://AKIA:wJalr/XUtn@bucket/store"},
        }
    )
    recorded = cfg.to_json()
    assert "s3cret" not in recorded and "wJalr" not in recorded
    assert "db/ledger" in recorded and "bucket/store" in recorded
    assert mask_tree({"a": ["s3://k:v@b/x", 3]}) == {"a": [f"s3://k:{MASK}@b/x", 3]}


@pytest.mark.parametrize(
    "ledger",
    ["postgresql+psycopg://ops@db/ledger?password=s3cret", "postgresql+psycopg://ops:s3/cret@db/ledger",
     "postgresql+psycopg://ops@db/ledger?options=-c%20password%3Ds3cret"],
)
def test_the_recorded_config_masks_every_ledger_password_shape(ledger):
    recorded = build_config({"ledger": {"url": ledger}}).to_json()
    assert "s3cret" not in recorded and "s3/cret" not in recorded and "db/ledger" in recorded


def test_log_records_and_their_tracebacks_are_masked():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    log = logging.getLogger(f"test-redact-{id(stream)}")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("connecting to %s", "postgresql://ops:hunter2@db/ledger")
        try:
            raise ConnectionError("cannot reach s3://bucket/x?secret=wJalrXUtn")
        except ConnectionError:
            log.exception("store down")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "hunter2" not in text and "wJalrXUtn" not in text
    assert "postgresql://ops:***@db/ledger" in text and "ConnectionError" in text
