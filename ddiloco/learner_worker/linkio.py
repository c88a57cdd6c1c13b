"""The link's ledger and store I/O: in the learner's process (:class:`LocalIO`), or in a process of its own
(:class:`IOProcess`, ``learners.link_process``).

A learner whose steps take milliseconds (a small model on a GPU) loses time to its link's threads even though their
work is small: each time one of them takes the GIL back (every SQL statement, every file call) the training thread,
which gives the GIL up in every torch op, waits for it. The I/O process holds the ledger engine and the stores, so the
learner's threads only send a request over a socket and wait without the GIL: a registration's SQL, the blob writes
and reads and their hashes run there, and so does the decoding of a received version (it holds the compact
downloads' bases), which comes back whole. Encoding stays in the learner, where the increment lives (on its device).

Requests and replies are JSON headers (``send_bytes``) with the blob bytes as a second message: nothing is pickled."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Protocol

import torch

from ddiloco.platform.compact import CompactError, CompactRef, Ref, plan_download
from ddiloco.platform.compression import CompactBase, CompressionError, Tensors, apply_encoded
from ddiloco.platform.config import build_config, secret_env
from ddiloco.platform.ledger import errors as errors_q
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.redact import redact_url
from ddiloco.platform.runtime import RunContext, ledger_retry, to_datetime
from ddiloco.platform.store import (
    BlobCorruptError,
    BlobExistsError,
    BlobInfo,
    BlobMissingError,
    StoreError,
    decode_tensors,
    encode_tensors,
)

log = logging.getLogger("ddiloco.learner")

START_TIMEOUT_S = 120.0
"""How long a learner waits for its I/O process to say it is ready (it imports torch and opens the ledger)."""

EXIT_WAIT_S = 5.0
"""How long a learner's thread whose connection to the I/O process broke waits for the process to end before it gives
the request up (a process that lives on has only dropped that connection)."""

_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (StoreError, BlobMissingError, BlobCorruptError, BlobExistsError, errors_q.SubmissionConflictError,
                errors_q.UnknownRunError, ValueError)
}
"""The errors an I/O process's reply raises again in the learner as themselves (callers tell a missing blob from a
ledger that is down); any other as :class:`LinkIOError`."""


class LinkIOError(RuntimeError):
    """The I/O process failed a request for a reason not in :data:`_ERRORS`, or is gone."""


class LinkIO(Protocol):
    """What the link's threads ask of the run's ledger and stores while the learner trains."""

    def put_blob(self, region: str, key: str, data: bytes) -> BlobInfo: ...

    def get_blob(self, key: str, sha256: str | None, nbytes: int | None) -> bytes: ...

    def fetch(self, row: learner_q.HeadRef, prefer: str | None) -> tuple[Tensors, int, str | None]: ...

    def exchange(self, learner_id: str, incarnation: int, subs: list[learner_q.SubmissionIn], beat: learner_q.Beat | None,
                 events: list[tuple[str, str]], known: dict[int, int]) -> tuple[float, learner_q.Exchange]: ...

    def close(self) -> None: ...


class LocalIO:
    """The I/O in this process, on the run's context."""

    def __init__(self, ctx: RunContext, device: torch.device | None = None) -> None:
        self.ctx = ctx
        self.bases: dict[int, CompactBase] = {}
        """Per fragment, the base of the compact downloads this learner holds (as the synchronizer does)."""
        self._fetch_lock = threading.Lock()
        """One fetch at a time: the bases change with each."""
        self.device = torch.device("cpu") if device is None else device
        """Where received versions are decoded and the bases kept: host memory, or a GPU learner's device
        (``learners.decode_on_device``), where only the blobs' compressed bytes are copied."""
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        """The side stream a GPU decodes on, beside the training stream."""
        self._consumer = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        """The stream that reads what a fetch returns: the training stream of the thread that made this I/O."""

    def put_blob(self, region: str, key: str, data: bytes) -> BlobInfo:
        return self.ctx.store(region).put_bytes(key, data)

    def get_blob(self, key: str, sha256: str | None, nbytes: int | None) -> bytes:
        return self.ctx.store().get_bytes(key, sha256, nbytes)

    def fetch(self, row: learner_q.HeadRef, prefer: str | None) -> tuple[Tensors, int, str | None]:
        """A version's tensors, the bytes fetched for them and the codec of the delta it came as (None: whole): by its
        compact form when the run publishes one (the blobs :func:`plan_download` picks; within the download codec's
        bound of the full blob), else the full blob. ``prefer``: the delta codec to take when the run offers it."""
        with self._fetch_lock:
            if self._stream is None:
                return self._fetch(row, prefer)
            with torch.cuda.stream(self._stream):
                tensors, nbytes, codec = self._fetch(row, prefer)
            # Decoded before the training thread can take it, and kept from the side stream's next allocations until the
            # training stream has done with it (the caching allocator only knows the stream a block was made on).
            self._stream.synchronize()
            for t in tensors.values():
                t.record_stream(self._consumer)
            return tensors, nbytes, codec

    def _read(self, key: str, sha256: str, nbytes: int | None = None) -> tuple[Tensors, dict[str, str]]:
        return decode_tensors(self.get_blob(key, sha256, nbytes), key)

    def _whole(self, key: str, sha256: str, nbytes: int | None = None) -> Tensors:
        """A full blob's tensors, where versions are decoded."""
        return {n: t.to(self.device) for n, t in self._read(key, sha256, nbytes)[0].items()}

    def _fetch(self, row: learner_q.HeadRef, prefer: str | None) -> tuple[Tensors, int, str | None]:
        try:
            ref = CompactRef.parse(row.compact_json)
        except CompactError as err:
            log.warning("fragment %s v%s: %s; downloading it whole", row.fragment, row.version, err)
            ref = None
        if ref is None:
            return self._whole(row.blob_key, row.sha256), row.nbytes, None
        held = self.bases.get(row.fragment)
        plan = plan_download(held.version if held else None, ref)
        fetched = 0

        def get(blob: Ref) -> tuple[Tensors, dict[str, str]]:
            nonlocal fetched
            tensors, meta = self._read(blob.key, blob.sha256, blob.nbytes)
            fetched += blob.nbytes
            return tensors, meta

        try:
            if plan[0] == "base":
                base = CompactBase(ref.base, {n: t.to(self.device, torch.float32) for n, t in get(ref.base_blob)[0].items()})
            elif plan[0] == "step":
                assert held is not None and ref.step is not None
                base = CompactBase(ref.base, apply_encoded(held.tensors, *get(ref.step)))
            else:
                assert held is not None
                base = held
            delta = ref.delta_for(prefer)
            tensors = apply_encoded(base.tensors, *get(delta))
            codec = ref.codec if delta is ref.delta else str(prefer)
        except CompressionError as err:
            # The synchronizer wrote these blobs and their hashes matched; a form that does not fit is a bug there:
            # drop the base and take the full blob, which never depends on one.
            log.warning("fragment %s v%s: compact form unusable (%s); downloading it whole", row.fragment, row.version, err)
            self.bases.pop(row.fragment, None)
            return self._whole(row.blob_key, row.sha256), fetched + row.nbytes, None
        self.bases[row.fragment] = base
        return tensors, fetched, codec

    @ledger_retry
    def exchange(self, learner_id: str, incarnation: int, subs: list[learner_q.SubmissionIn], beat: learner_q.Beat | None,
                 events: list[tuple[str, str]], known: dict[int, int]) -> tuple[float, learner_q.Exchange]:
        """(the time it was written at, the exchange): :func:`learner_q.learner_exchange` in one transaction."""
        with self.ctx.transaction() as s:
            # The clock is read once the connection is checked out (and pinged), at every attempt: an exchange that
            # waited out a partition must not write the time it began, or the heartbeat that ends the partition reads
            # as one from before it, and the submissions it brings as a dead learner's.
            s.connection()
            now = self.ctx.now()
            return now, learner_q.learner_exchange(s, self.ctx.run_id, learner_id, incarnation, subs, beat, to_datetime(now),
                                                   events=events, known=known)

    def close(self) -> None:
        pass


# --- the wire -------------------------------------------------------------------------------------------------------


def _exchange_request(learner_id: str, incarnation: int, subs: list[learner_q.SubmissionIn], beat: learner_q.Beat | None,
                      events: list[tuple[str, str]], known: dict[int, int]) -> dict[str, Any]:
    return {"op": "exchange", "learner_id": learner_id, "incarnation": incarnation,
            "subs": [dataclasses.asdict(sub) for sub in subs], "beat": dataclasses.asdict(beat) if beat else None,
            "events": [list(e) for e in events], "known": {str(f): v for f, v in known.items()}}


def _exchange_reply(now: float, ex: learner_q.Exchange) -> dict[str, Any]:
    return {"ok": True, "now": now, "registered": [list(r) for r in ex.registered], "current": ex.current,
            "run_status": ex.run_status, "heads": [list(h) for h in ex.heads.values()]}


def _exchange_of(reply: dict[str, Any]) -> tuple[float, learner_q.Exchange]:
    heads = {int(h[0]): learner_q.HeadRef(*h) for h in reply["heads"]}
    registered = [(int(i), bool(c)) for i, c in reply["registered"]]
    return float(reply["now"]), learner_q.Exchange(registered, bool(reply["current"]), reply["run_status"], heads)


def _handle(io: LocalIO, req: dict[str, Any], payload: bytes | None) -> tuple[dict[str, Any], bytes | None]:
    op = req.get("op")
    if op == "put":
        if payload is None:
            raise ValueError("a put carries its blob")
        blob = io.put_blob(req["region"], req["key"], payload)
        return {"ok": True, "key": blob.key, "sha256": blob.sha256, "nbytes": blob.nbytes}, None
    if op == "get":
        return {"ok": True, "payload": True}, io.get_blob(req["key"], req["sha256"], req["nbytes"])
    if op == "seed":
        if payload is None:
            raise ValueError("a seed carries its base")
        io.bases[int(req["fragment"])] = CompactBase(int(req["version"]), decode_tensors(payload)[0])
        return {"ok": True}, None
    if op == "fetch":
        tensors, nbytes, codec = io.fetch(learner_q.HeadRef(*req["row"]), req["prefer"])
        return {"ok": True, "payload": True, "nbytes": nbytes, "codec": codec}, encode_tensors(tensors)
    if op == "exchange":
        beat = learner_q.Beat(**req["beat"]) if req["beat"] else None
        subs = [learner_q.SubmissionIn(**sub) for sub in req["subs"]]
        now, ex = io.exchange(req["learner_id"], int(req["incarnation"]), subs, beat, [tuple(e) for e in req["events"]],
                              {int(f): int(v) for f, v in req["known"].items()})
        return _exchange_reply(now, ex), None
    raise ValueError(f"unknown request {str(op)[:20]!r}")


def _serve(io: LocalIO, conn: Connection) -> None:
    """Answer one learner thread's requests, in order, until it hangs up."""
    with conn:
        while True:
            try:
                req = json.loads(conn.recv_bytes())
                payload = conn.recv_bytes() if req.get("payload") else None
            except (EOFError, OSError):
                return
            try:
                reply, data = _handle(io, req, payload)
            except Exception as err:  # noqa: BLE001 - the learner's thread gets it as its own call would have
                reply, data = {"ok": False, "type": type(err).__name__, "message": redact_url(str(err))}, None
            try:
                conn.send_bytes(json.dumps(reply).encode())
                if data is not None:
                    conn.send_bytes(data)
            except OSError:
                return


def _warm_up(io: LocalIO, learner_id: str, incarnation: int, region: str) -> None:
    """The learner's stores opened and a registration exchange of its rolled back: a new process opens them, its
    connection and compiles its statements at its first put and exchange (0.1 s each on a slow CPU), and meanwhile
    the sends of the steps it held back coalesce."""
    for r in (region, None):
        io.ctx.store(r)
    sub = learner_q.SubmissionIn("~warm-up", 0, 0, 1, 1, 1, 1, "~warm-up", "0" * 64, 1, "none", data_batches=0)
    beat = learner_q.Beat(0, 0, 1.0, 0.0, 0.0, history=True, queue_depth=0, oldest_unsent_s=0.0)
    try:
        with io.ctx.sessions() as s:
            try:
                learner_q.learner_exchange(s, io.ctx.run_id, learner_id, incarnation, [sub], beat, to_datetime(io.ctx.now()),
                                           known={})
            finally:
                s.rollback()
    except Exception as err:  # noqa: BLE001 - only a warm-up: the learner's own first exchange says what is wrong
        log.warning("the link's I/O process could not warm up: %s", redact_url(str(err)))


def serve(spec: dict[str, Any]) -> None:
    """The I/O process's main: open the run, listen, say so on stdout, and answer until the learner is gone (its end of
    stdin closes, also when it is SIGKILLed)."""
    io = LocalIO(RunContext.open(build_config(spec["config"]), spec["run_id"]))
    if spec.get("learner_id") is not None:
        _warm_up(io, spec["learner_id"], int(spec["incarnation"]), spec["region"])
    # A socket in a folder only this user can enter, and a key the learner gave on stdin.
    folder = tempfile.mkdtemp(prefix="ddiloco-linkio-")
    listener = Listener(os.path.join(folder, "socket"), family="AF_UNIX", backlog=16, authkey=bytes.fromhex(spec["authkey"]))

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()
            except Exception:  # noqa: BLE001 - a peer that failed the handshake is not the learner: keep listening
                log.warning("the link's I/O process refused a connection")
                continue
            threading.Thread(target=_serve, args=(io, conn), name="linkio-serve", daemon=True).start()

    threading.Thread(target=accept, name="linkio-accept", daemon=True).start()
    sys.stdout.write(json.dumps({"address": listener.address}) + "\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the learner closes it or dies
    listener.close()
    shutil.rmtree(folder, ignore_errors=True)
    os._exit(0)  # daemon threads may be mid-request for a learner that is gone


# --- the learner's side ---------------------------------------------------------------------------------------------


class IOProcess:
    """The link's I/O in a child process. Each of the learner's threads talks to it over a connection of its own (the
    child answers each on a thread), so an upload and a download do not queue behind each other. A child that died is
    started again at the next request, which is then made once more (each is safe to repeat: a blob of the same bytes,
    a registration of the same rows)."""

    def __init__(self, ctx: RunContext, learner_id: str | None = None, incarnation: int = -1, region: str = "") -> None:
        """``learner_id``, ``incarnation`` and ``region``: the registered learner it serves, whose exchange and stores
        it warms up."""
        self.ctx = ctx
        # The config goes as the saved config does, its secrets masked; the child takes them from its environment.
        self._spec = {"config": ctx.cfg.model_dump(mode="json"), "run_id": ctx.run_id, "learner_id": learner_id,
                      "incarnation": incarnation, "region": region}
        self._env = {**{k: v for k, v in os.environ.items() if k not in ("DDILOCO_FAULTS", "DDILOCO_FAULT_DIR")},
                     **secret_env(ctx.cfg)}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._generation = 0
        self.starts = 0
        self._proc: subprocess.Popen | None = None
        self._start()

    def _start(self) -> None:
        key = os.urandom(32)
        proc = subprocess.Popen([sys.executable, "-c", "from ddiloco.entry import link_io_main; link_io_main()"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=self._env, close_fds=True)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write((json.dumps({**self._spec, "authkey": key.hex()}) + "\n").encode())
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else b""
        if not line:
            proc.kill()
            raise LinkIOError(f"the link's I/O process did not start (exit code {proc.wait()}; its log has why)")
        self._address, self._key, self._proc = json.loads(line)["address"], key, proc
        self._generation += 1
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _connection(self) -> Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.generation != self._generation:
            with self._lock:
                if self._proc is None:
                    raise LinkIOError("the link's I/O process is closed")
                address, key, generation = self._address, self._key, self._generation
            conn = Client(address, family="AF_UNIX", authkey=key)
            self._local.conn, self._local.generation = conn, generation
        return conn

    def _call(self, req: dict[str, Any], payload: bytes | None = None) -> tuple[dict[str, Any], bytes | None]:
        for attempt in range(2):
            try:
                conn = self._connection()
                conn.send_bytes(json.dumps({**req, "payload": payload is not None}).encode())
                if payload is not None:
                    conn.send_bytes(payload)
                reply = json.loads(conn.recv_bytes())
                data = conn.recv_bytes() if reply.get("payload") else None
                break
            except (EOFError, OSError) as err:
                self._local.conn = None
                if attempt or not self._restart_if_dead():
                    raise LinkIOError(f"the link's I/O process did not answer: {type(err).__name__}") from None
        if not reply.get("ok"):
            raise _ERRORS.get(reply.get("type"), LinkIOError)(str(reply.get("message"))[:2000])
        return reply, data

    def _restart_if_dead(self) -> bool:
        """Start the child again if it has died; whether it had (and the request is worth making again)."""
        with self._lock:
            if self._proc is None:
                return False
            try:
                # A child whose connection broke is dying, or dead: killed, its threads may still be exiting (only
                # then can it be reaped).
                self._proc.wait(timeout=EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                return False
            log.warning("the link's I/O process exited (code %s); starting it again", self._proc.returncode)
            self._start()
            return True

    def put_blob(self, region: str, key: str, data: bytes) -> BlobInfo:
        reply, _ = self._call({"op": "put", "region": region, "key": key}, data)
        return BlobInfo(reply["key"], reply["sha256"], int(reply["nbytes"]))

    def get_blob(self, key: str, sha256: str | None, nbytes: int | None) -> bytes:
        _, data = self._call({"op": "get", "key": key, "sha256": sha256, "nbytes": nbytes})
        assert data is not None
        return data

    def seed(self, bases: dict[int, CompactBase]) -> None:
        """Give the child the compact downloads' bases the learner holds already: without them its first download of
        each fragment would fetch a float32 base again (the whole model, once more, over the learner's link)."""
        for fragment, base in bases.items():
            self._call({"op": "seed", "fragment": fragment, "version": base.version}, encode_tensors(base.tensors))

    def fetch(self, row: learner_q.HeadRef, prefer: str | None) -> tuple[Tensors, int, str | None]:
        """The version decoded in the child (which holds the compact bases), its float32 tensors sent back whole."""
        reply, data = self._call({"op": "fetch", "row": list(row), "prefer": prefer})
        assert data is not None
        return decode_tensors(data, row.blob_key)[0], int(reply["nbytes"]), reply["codec"]

    def exchange(self, learner_id: str, incarnation: int, subs: list[learner_q.SubmissionIn], beat: learner_q.Beat | None,
                 events: list[tuple[str, str]], known: dict[int, int]) -> tuple[float, learner_q.Exchange]:
        reply, _ = self._call(_exchange_request(learner_id, incarnation, subs, beat, events, known))
        return _exchange_of(reply)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the child (its stdin closes) and wait for it."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
