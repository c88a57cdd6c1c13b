"""One rule masks a URL's password, whatever the URL: ledger, store bucket or region."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from ddiloco.platform.config import build_config
from ddiloco.platform.redact import MASK, mask_tree, redact_url

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
    ],
)
def test_text_without_a_password_is_kept_exactly(text):
    assert redact_url(text) == text


def test_a_url_that_cannot_be_parsed_is_hidden_whole():
    assert redact_url("s3://key:secret@bucket:notaport/x") == MASK


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
