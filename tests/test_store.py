"""The fragment store on file://, memory:// and s3:// (moto): immutability, integrity, no pickle, safe keys."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import threading
import uuid

import pytest
import torch

from ddiloco.platform import ids
from ddiloco.platform.ids import InvalidIdError
from ddiloco.platform.store import (
    BlobCorruptError,
    BlobExistsError,
    BlobMissingError,
    FragmentStore,
    sha256_hex,
)

KEY = "run1/global/f0/v0.safetensors"


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(16, 8, generator=g),
        "b": torch.randn(8, generator=g).to(torch.bfloat16),
        "q": torch.randint(-8, 8, (33,), generator=g, dtype=torch.int8),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


@pytest.fixture
def store(store_url) -> FragmentStore:
    return FragmentStore(store_url)


def plant(store: FragmentStore, key: str, data: bytes) -> None:
    """Write raw bytes under a key straight through the store's own fsspec filesystem, bypassing put()."""
    path = store.path(key)
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(path, data)


class _Evil:
    """Unpickling this creates ``path``: a stand-in for arbitrary code execution."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# --- round trip and immutability ----------------------------------------------------------------------


def test_put_get_round_trip_with_metadata(store):
    data = tensors()
    meta = {"run": "run1", "fragment": "0", "codec": "int8", "note": "ünïcode ok"}
    info = store.put(KEY, data, meta)
    raw = store.get_bytes(KEY)
    assert info.key == KEY and info.nbytes == len(raw) and info.sha256 == sha256_hex(raw)
    got, got_meta = store.get_with_metadata(KEY, info.sha256)
    assert_same(got, data)
    assert got_meta == meta
    assert_same(store.get(KEY), data)  # sha256 optional
    assert store.exists(KEY) and store.verify(KEY, info.sha256)
    assert not store.verify(KEY, "0" * 64)
    # A fresh store object on the same URL (another process, in effect) reads the same blob.
    assert_same(FragmentStore(store.url).get(KEY, info.sha256), data)


def test_blobs_are_immutable(store):
    first = store.put(KEY, tensors(0))
    with pytest.raises(BlobExistsError, match="immutable"):
        store.put(KEY, tensors(1))
    again = store.put(KEY, tensors(0))  # identical re-put (a retried upload) is accepted
    assert again == first
    assert_same(store.get(KEY, first.sha256), tensors(0))  # the first content survived
    with pytest.raises(BlobExistsError):
        store.put_bytes(KEY, b"something else entirely")


# --- integrity ---------------------------------------------------------------------------------------


def test_sha256_mismatch_is_corrupt_and_names_the_key(store):
    info = store.put(KEY, tensors())
    wrong = sha256_hex(b"other")
    with pytest.raises(BlobCorruptError) as err:
        store.get(KEY, wrong)
    assert KEY in str(err.value)
    # Same length, one byte flipped in the data section: only the checksum can tell.
    raw = bytearray(store.get_bytes(KEY))
    raw[-1] ^= 0xFF
    key2 = "run1/global/f0/v1.safetensors"
    plant(store, key2, bytes(raw))
    store.get(key2)  # still parses ...
    with pytest.raises(BlobCorruptError, match="v1.safetensors"):
        store.get(key2, info.sha256)  # ... but it is not the registered blob


@pytest.mark.parametrize("cut", [4, 20, -7], ids=["len-prefix", "header", "data"])
def test_truncated_blob_is_corrupt(store, cut):
    store.put(KEY, tensors())
    raw = store.get_bytes(KEY)
    key = f"run1/submissions/f0/l0/trunc{cut}.safetensors"
    # Written straight through the same fsspec filesystem, bypassing put(): a torn upload.
    plant(store, key, raw[:cut])
    with pytest.raises(BlobCorruptError) as err:
        store.get(key)
    assert key in str(err.value)
    with pytest.raises(BlobCorruptError):
        store.get(key, sha256_hex(raw))


def test_missing_blob(store):
    with pytest.raises(BlobMissingError, match="nothing/here.safetensors"):
        store.get("nothing/here.safetensors")
    with pytest.raises(BlobMissingError):
        store.get_bytes("nothing/here.safetensors", "0" * 64)
    assert not store.exists("nothing/here.safetensors")


@pytest.mark.parametrize("flavour", ["pickle", "torch.save"])
def test_planted_pickle_is_refused_and_never_executed(store, tmp_path, flavour):
    # The payload is live: read without running, its opcodes call builtins.open(marker, "w").
    probe = str(tmp_path / f"probe-{uuid.uuid4().hex}")
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(pickle.dumps(_Evil(probe)))]
    strings = {arg for name, arg in ops if name.endswith("UNICODE")}
    assert {"io", "open", probe, "w"} <= strings and ("REDUCE", None) in ops

    marker = tmp_path / f"pwned-{uuid.uuid4().hex}"
    if flavour == "pickle":
        payload = pickle.dumps({"w": _Evil(str(marker))})
    else:
        buf = io.BytesIO()
        torch.save({"w": torch.zeros(3), "x": _Evil(str(marker))}, buf)
        payload = buf.getvalue()
    key = "run1/global/f0/v9.safetensors"
    plant(store, key, payload)
    with pytest.raises(BlobCorruptError, match="v9.safetensors"):
        store.get(key)
    with pytest.raises(BlobCorruptError):
        store.get(key, sha256_hex(payload))  # even with the "right" checksum
    assert not store.verify(key, sha256_hex(payload))
    assert not marker.exists()


# --- keys and ids ------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/../b", "a/./b", "a/", "", ".."])
def test_unsafe_keys_are_refused(store, key):
    with pytest.raises(InvalidIdError):
        store.put(key, tensors())
    with pytest.raises(InvalidIdError):
        store.get(key)
    with pytest.raises(InvalidIdError):
        store.exists(key)
    with pytest.raises(InvalidIdError):
        store.delete(key)
    assert store.list() == []


@pytest.mark.parametrize("bad", ["..", "../etc", "a/b", "/abs", "", ".hidden", "a..b", "x" * 65, "a b", "a\\b", "é"])
def test_unsafe_ids_in_key_builders(bad):
    with pytest.raises(InvalidIdError):
        ids.global_key(bad, 0, 0)
    with pytest.raises(InvalidIdError):
        ids.outer_state_key(bad, 0, 0)
    with pytest.raises(InvalidIdError):
        ids.submission_key("run", 0, bad, "uid")
    with pytest.raises(InvalidIdError):
        ids.submission_key("run", 0, "learner", bad)
    with pytest.raises(InvalidIdError):
        ids.learner_state_key("run", bad, "s1")


def test_id_with_trailing_newline_is_refused():
    with pytest.raises(InvalidIdError):
        ids.validate_id("run1\n")


def test_key_builders_accept_good_ids():
    assert ids.global_key("run-1", 3, 7) == "run-1/global/f3/v7.safetensors"
    assert ids.submission_key("r", 2, "us-0", "a1b2") == "r/submissions/f2/us-0/a1b2.safetensors"
    assert ids.learner_state_key("r", "eu_1", "s.3") == "r/learners/eu_1/s.3"
    assert ids.outer_state_key("r", 0, 0) == "r/outer/f0/v0.safetensors"


# --- local disk specifics ----------------------------------------------------------------------------


def _files_under(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_file_store_leaves_no_temp_files(tmp_path):
    store = FragmentStore(f"file://{tmp_path}/store")
    for v in range(5):
        store.put(ids.global_key("r", 0, v), tensors(v))
    with pytest.raises(BlobExistsError):
        store.put(ids.global_key("r", 0, 0), tensors(99))
    store.put(ids.global_key("r", 0, 1), tensors(1))
    assert _files_under(store.root) == [f"r/global/f0/v{v}.safetensors" for v in range(5)]


def test_file_store_concurrent_put_has_one_winner(tmp_path):
    store = FragmentStore(f"file://{tmp_path}/store")
    a, b = tensors(1), tensors(2)
    for round_ in range(20):
        key = f"r/global/f0/v{round_}.safetensors"
        barrier = threading.Barrier(2)
        outcome: dict[str, object] = {}

        def put(name: str, data: dict[str, torch.Tensor], barrier=barrier, outcome=outcome, key=key) -> None:
            barrier.wait(timeout=10)
            try:
                outcome[name] = store.put(key, data)
            except BlobExistsError as err:
                outcome[name] = err

        threads = [threading.Thread(target=put, args=("a", a)), threading.Thread(target=put, args=("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
        winners = [n for n, v in outcome.items() if not isinstance(v, Exception)]
        losers = [n for n, v in outcome.items() if isinstance(v, BlobExistsError)]
        assert len(winners) == 1 and len(losers) == 1, outcome
        assert_same(store.get(key, outcome[winners[0]].sha256), a if winners[0] == "a" else b)
    assert not [f for f in _files_under(store.root) if ".tmp-" in f]


# --- list and delete ---------------------------------------------------------------------------------


def test_list_and_delete(store):
    keys = [
        "r/global/f0/v0.safetensors",
        "r/global/f1/v0.safetensors",
        "r/submissions/f0/us-0/u1.safetensors",
        "other/global/f0/v0.safetensors",
    ]
    for i, k in enumerate(keys):
        store.put(k, tensors(i))
    assert store.list() == sorted(keys)
    assert store.list("r") == sorted(keys[:3])
    assert store.list("r/global") == keys[:2]
    assert store.list("r/global/") == keys[:2]
    assert store.list("nope") == []
    store.delete(keys[0])
    assert not store.exists(keys[0]) and store.exists(keys[1])
    assert store.list("r/global") == keys[1:2]
    with pytest.raises(BlobMissingError):
        store.get(keys[0])
    store.delete(keys[0])  # deleting a missing blob is a no-op
    # A deleted key may be written again (GC then re-publish is not expected, but must not wedge).
    store.put(keys[0], tensors(7))
    assert_same(store.get(keys[0]), tensors(7))


def test_a_listing_never_hides_blobs_written_after_it(store_url):
    """A reader that listed a prefix still reads blobs another process wrote there afterwards
    (s3fs answers reads from its cached listing unless the store turns that cache off)."""
    writer = FragmentStore(store_url)
    reader = FragmentStore(store_url, {"skip_instance_cache": True} if store_url.startswith("s3://") else None)
    writer.put("r/submissions/f0/us-0/a.safetensors", tensors(0))
    assert reader.list("r/submissions") == ["r/submissions/f0/us-0/a.safetensors"]
    later = writer.put("r/submissions/f0/us-0/b.safetensors", tensors(1))
    assert reader.exists(later.key)
    assert reader.verify(later.key, later.sha256)
    assert_same(reader.get(later.key, later.sha256), tensors(1))


def test_an_s3_store_bounds_a_network_stall_and_keeps_the_options_it_is_given(s3_endpoint):
    """s3fs's sockets get platform.stall's TCP_USER_TIMEOUT (the cut itself: tests/test_multiregion.py); the options
    given are not written to, a socket factory of their own wins, and other filesystems get their options as given."""
    import socket

    import s3fs

    from ddiloco.platform import stall

    assert stall.store_options("file:///tmp/x", {"auto_mkdir": True}) == {"auto_mkdir": True}
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    given = {"config_kwargs": {"retries": {"total_max_attempts": 2}}}
    store = FragmentStore(f"s3://{bucket}/root", given)
    store.put("k", tensors())
    assert "connector_args" not in given["config_kwargs"]  # the caller's options are not written to
    config = store.fs.s3._client_config
    assert config.retries["total_max_attempts"] == 2
    sock = config.connector_args["socket_factory"]((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", 0)))
    with sock:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == int(stall.STALL_TIMEOUT_S * 1000)

    def own(addr_info):
        return socket.socket(*addr_info[:3])

    mine = stall.store_options("s3://b/root", {"config_kwargs": {"connector_args": {"socket_factory": own}}})
    assert mine["config_kwargs"]["connector_args"]["socket_factory"] is own
