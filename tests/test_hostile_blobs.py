"""Poison blobs: every shape is refused with a reason, fast and with bounded memory, and never stalls a fragment."""

from __future__ import annotations

import json
import os
import time
import tracemalloc
import uuid

import pytest
import torch
from support import drive, setup_run, shapes_of

from ddiloco.platform.compression import encode_delta
from ddiloco.platform.ids import submission_key
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.models import Submission
from ddiloco.platform.runtime import to_datetime
from ddiloco.platform.store import (
    MAX_HEADER_BYTES,
    MAX_JSON_DEPTH,
    BlobCorruptError,
    BlobMissingError,
    FragmentStore,
    encode_tensors,
    json_depth,
    sha256_hex,
)

DEEP = 100_000


def raw_blob(header: bytes | dict, payload: bytes = b"") -> bytes:
    """Safetensors framing (8-byte little-endian length, header, payload) around any header."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + payload


def deep_json(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


def valid_with_metadata(**metadata: str) -> bytes:
    return encode_tensors({"w": torch.zeros(4)}, metadata)


# Each shape, and the words its rejection reason must hold.
POISON = {
    "deep JSON header": (raw_blob(deep_json().encode()), "not a valid safetensors"),
    "deep JSON under a tensor entry": (raw_blob({"w": json.loads(deep_json(64))}), "not a valid safetensors"),
    "deep JSON in an unknown field of a tensor entry": (
        raw_blob(f'{{"w": {{"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": {deep_json(200)}}}}}'.encode(), b"\0" * 4),
        "recursion limit exceeded",
    ),
    "deep __metadata__ object": (raw_blob(f'{{"__metadata__": {{"a": {deep_json()}}}}}'.encode()), "not a valid safetensors"),
    "deep JSON inside a __metadata__ string": (valid_with_metadata(tensors=deep_json()), "__metadata__ 'tensors' nested deeper"),
    "deep JSON after spaces in a __metadata__ string": (valid_with_metadata(tensors="  " + deep_json()), "nested deeper"),
    "header length beyond any bound": ((1 << 40).to_bytes(8, "little") + b"{}", "header"),
    "header longer than the blob": ((500).to_bytes(8, "little") + b"{}", "bad header length"),
    "header that is not UTF-8": (raw_blob(b'{"\xff\xfe": 1}'), "not a valid safetensors"),
    "header that is a list": (raw_blob(b"[1, 2]"), "not a valid safetensors"),
    "__metadata__ with a number": (raw_blob({"__metadata__": {"a": 1}}), "not a valid safetensors"),
    "unknown dtype": (raw_blob({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "not a valid safetensors"),
    "shape that disagrees with its bytes": (
        raw_blob({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4]}}, b"\0" * 4),
        "not a valid safetensors",
    ),
    "offsets past the end (truncated payload)": (
        raw_blob({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
        "not a valid safetensors",
    ),
    "truncated framing": (b"\x10\0\0", "truncated"),
    "pickle": (b"\x80\x04\x95" + b"\0" * 40, "safetensors"),
}


@pytest.fixture
def store(store_url) -> FragmentStore:
    return FragmentStore(store_url)


def plant(store: FragmentStore, key: str, data: bytes) -> None:
    path = store.path(key)
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(path, data)


def test_json_depth_ignores_brackets_inside_strings():
    assert json_depth(b'{"a": [1, {"b": "[[[[{{{{"}]}') == 3
    assert json_depth(b'{"a\\"[[[": 1}') == 1
    assert json_depth(deep_json().encode()) == DEEP
    assert json_depth(b"") == 0


@pytest.mark.parametrize("shape", list(POISON))
def test_every_poison_shape_is_refused_with_a_reason(store, shape):
    data, needle = POISON[shape]
    key = f"r/submissions/f0/l/{uuid.uuid4().hex[:8]}.safetensors"
    plant(store, key, data)
    start = time.perf_counter()
    with pytest.raises(BlobCorruptError) as err:
        store.get_with_metadata(key, sha256_hex(data), len(data))
    assert needle in str(err.value), str(err.value)
    assert key in str(err.value) and len(str(err.value)) < 400
    assert time.perf_counter() - start < 5.0  # ms when idle; generous for a loaded machine


def test_an_honest_header_is_well_inside_the_bounds():
    enc, meta = encode_delta({f"layer{i}.w": torch.zeros(3, 3) for i in range(200)}, "int8")
    data = encode_tensors(enc, meta)
    header_len = int.from_bytes(data[:8], "little")
    assert header_len * 100 < MAX_HEADER_BYTES
    assert json_depth(data[8 : 8 + header_len]) <= 3 and json_depth(meta["tensors"].encode()) <= 3 < MAX_JSON_DEPTH


def test_a_huge_file_behind_a_small_claim_is_never_read(tmp_path):
    store = FragmentStore(f"file://{tmp_path}/store")
    key = "r/submissions/f0/l/huge.safetensors"
    path = store.path(key)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(valid_with_metadata()[:300])
        f.truncate(1 << 30)  # 1 GiB, sparse: costs no disk
    tracemalloc.start()
    try:
        with pytest.raises(BlobCorruptError, match="larger than the 300 bytes registered"):
            store.get_bytes(key, "0" * 64, 300)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse a 300-byte claim"


@pytest.mark.parametrize("claim, needle", [(64, "larger than the 64"), (100_000, "not the 100000")])
def test_a_blob_whose_size_is_not_the_claim_is_refused(store, claim, needle):
    data = valid_with_metadata()
    key = "r/submissions/f0/l/sized.safetensors"
    plant(store, key, data)
    with pytest.raises(BlobCorruptError, match=needle):
        store.get_bytes(key, sha256_hex(data), claim)
    assert store.get_bytes(key, sha256_hex(data), len(data)) == data


@pytest.mark.parametrize("claim", [0, -1, 1 << 62])
def test_an_impossible_size_claim_is_refused_before_reading(store, claim):
    with pytest.raises(BlobCorruptError, match="registered with"):
        store.get_bytes("r/submissions/f0/l/none.safetensors", "0" * 64, claim)


def test_a_key_naming_a_directory_is_refused_at_once(tmp_path):
    store = FragmentStore(f"file://{tmp_path}/store")
    plant(store, "r/submissions/f0/l/x.safetensors", valid_with_metadata())
    start = time.perf_counter()
    with pytest.raises((BlobCorruptError, BlobMissingError)):
        store.get_bytes("r/submissions/f0/l", "0" * 64, 300)
    assert time.perf_counter() - start < 3.0  # not retried as if the disk were flaky (6 tries took 6 s)


def test_reasons_never_hold_the_store_url(tmp_path):
    url = f"file://{tmp_path}/secret-root"
    store = FragmentStore(url)
    with pytest.raises(BlobMissingError) as err:
        store.get_bytes("r/submissions/f0/l/gone.safetensors", "0" * 64, 300)
    assert "secret-root" not in str(err.value) and str(tmp_path) not in str(err.value)


# --- in a live run: the synchronizer rejects each poison and the fragment keeps merging ---------------


def register_raw(ctx, clock, fragment: int, data: bytes, *, nbytes: int | None = None, learner: str = "us-1") -> int:
    uid = uuid.uuid4().hex[:12]
    key = submission_key(ctx.run_id, fragment, learner, uid)
    plant(ctx.store("us"), key, data)
    sub = learner_q.SubmissionIn(uid, fragment, 0, 3, 300, 300, 300, key, sha256_hex(data), len(data) if nbytes is None else nbytes, "none")
    with ctx.transaction() as s:
        return learner_q.register_submission(s, ctx.run_id, learner, 0, sub, to_datetime(clock.t))[0]


def test_poison_submissions_are_rejected_and_their_fragment_keeps_publishing():
    cfg, clock, ctx, sync, good = setup_run()
    with ctx.transaction() as s:
        learner_q.register_learner(s, ctx.run_id, "us-1", "us", to_datetime(clock.t))
        before = runs_q.latest_version_numbers(s, ctx.run_id)[0]
    enc, meta = encode_delta({n: torch.zeros(s_) for n, s_ in shapes_of(sync, 0).items()}, "none")
    honest = encode_tensors(enc, meta)
    deep_meta = encode_tensors(enc, {**meta, "tensors": deep_json()})
    one_block, one_block_meta = encode_delta({n: torch.zeros(s_) for n, s_ in shapes_of(sync, 0).items()}, "int8", block_size=1 << 20)
    bad = {
        register_raw(ctx, clock, 0, raw_blob(deep_json().encode())): "not a valid safetensors",
        register_raw(ctx, clock, 0, deep_meta): "nested deeper",
        register_raw(ctx, clock, 0, honest + b"\0" * 100_000, nbytes=300): "larger than the 300 bytes",
        register_raw(ctx, clock, 0, honest[:-7]): "not a valid safetensors",
        register_raw(ctx, clock, 0, honest, nbytes=1 << 40): "more than the",
        # A block size no tensor can be viewed with (the decoder raised TypeError out of the poll).
        register_raw(ctx, clock, 0, encode_tensors(one_block, {**one_block_meta, "block_size": str(10**30)})): "bad update",
    }
    drive(clock, sync, good, 3 * cfg.fragments.count)
    with ctx.transaction() as s:
        for sid, needle in bad.items():
            row = s.get(Submission, sid)
            assert row.status == "rejected" and needle in row.reject_reason, (needle, row.status, row.reject_reason)
            assert ctx.cfg.storage.url not in row.reject_reason
        after = runs_q.latest_version_numbers(s, ctx.run_id)[0]
    assert after >= before + 2, (before, after)


def test_a_store_shows_its_url_masked():
    assert repr(FragmentStore("s3://AKIAEX:wJalrSECRET@bucket/root")) == "FragmentStore('s3://AKIAEX:***@bucket/root')"
