"""The multi-region benchmark's machinery (benchmarks/multiregion.py), checked for real:

- a tbf-shaped veth link between a network namespace and the root namespace really limits a transfer;
- the user-space delay relay (this kernel has no netem) really adds its one-way delay each way;
- cutting a region off (both veth ends down) stalls its open TCP connections and refuses new ones until it heals;
- the ledger's and the store's clients drop a connection the cut stalled within ``platform.stall``'s bound, and
  work again on new ones after the heal;
- a learner process inside a region namespace registers, steps and submits fragments through its
  shaped, delayed link to moto's S3 server and PostgreSQL, and those bytes crossed the veth.

Needs root, ``ip netns`` and tc's tbf (skipped with the reason otherwise); the learner case also
needs PostgreSQL (the ``postgres_url`` fixture). Every namespace, veth and qdisc is removed after."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from ddiloco.testing.net import EchoServer, free_port, poll_until, wait_for
from ddiloco.testing.processes import stop_processes

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import multiregion as mr  # noqa: E402

_WHY = mr.netns_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_WHY is not None, reason=f"network namespaces unavailable: {_WHY}")]


def _receive_all(srv: socket.socket, out: dict) -> None:
    conn, _ = srv.accept()
    n, first, last = 0, None, None
    with conn:
        while True:
            data = conn.recv(65536)
            if not data:
                break
            now = time.perf_counter()
            first = first or now
            last = now
            n += len(data)
    out.update(n=n, first=first, last=last)


def _send_from_namespace(topo: mr.Topology, nbytes: int) -> dict:
    """Send nbytes from inside the region namespace to the root namespace; the receiver's timing."""
    r = topo.regions[0]
    out: dict = {}
    with socket.socket() as srv:
        srv.bind((r.host_ip, 0))
        srv.listen(1)
        t = threading.Thread(target=_receive_all, args=(srv, out), daemon=True)
        t.start()
        code = (
            f"import socket; s = socket.create_connection(('{r.host_ip}', {srv.getsockname()[1]})); s.sendall(b'x' * {nbytes}); s.close()"
        )
        subprocess.run(["ip", "netns", "exec", r.ns, sys.executable, "-c", code], check=True, timeout=60)
        t.join(30)
    assert out.get("n") == nbytes
    return out


def test_tbf_shaped_veth_limits_a_transfer():
    topo = mr.Topology(["t"])
    ns = topo.regions[0].ns
    try:
        free = _send_from_namespace(topo, 1_500_000)
        topo.shape(4.0)
        limited = _send_from_namespace(topo, 1_500_000)
        up = topo.counters()["t"]["up"]
    finally:
        topo.close()
    rate_limited = 1_500_000 * 8 / (limited["last"] - limited["first"]) / 1e6
    rate_free = 1_500_000 * 8 / max(1e-3, free["last"] - free["first"]) / 1e6
    assert rate_limited < 4.0 * 1.3, f"shaped to 4 Mbit/s, measured {rate_limited:.1f}"
    assert rate_limited > 4.0 * 0.5, f"shaped to 4 Mbit/s, measured only {rate_limited:.1f}"
    assert rate_free > 3 * rate_limited, f"unshaped {rate_free:.1f} Mbit/s is not clearly faster than shaped {rate_limited:.1f}"
    assert up >= 2 * 1_500_000  # both transfers crossed this veth
    assert not Path(f"/var/run/netns/{ns}").exists()  # removed by close()


_PARTITION_CLIENT = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
held = socket.create_connection((host, port), timeout=10)
held.sendall(b"a")
print("connected", flush=True)
sys.stdin.readline()  # the region is cut off now
held.sendall(b"b")  # only queued: nothing can leave
try:
    socket.create_connection((host, port), timeout=5).close()
    print("new connection: made", flush=True)
except OSError as err:
    print(f"new connection: {err.strerror}", flush=True)
sys.stdin.readline()  # healed
fresh = socket.create_connection((host, port), timeout=10)
fresh.sendall(b"c")
fresh.close()
held.close()
"""


class _Collector:
    """Accepts connections at (host, 0) and records what each sends, by connection in order of arrival."""

    def __init__(self, host: str) -> None:
        self.srv = socket.create_server((host, 0))
        self.port = self.srv.getsockname()[1]
        self.got: list[bytearray] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            buf = bytearray()
            self.got.append(buf)
            threading.Thread(target=self._read, args=(conn, buf), daemon=True).start()

    @staticmethod
    def _read(conn: socket.socket, buf: bytearray) -> None:
        with conn:
            while data := conn.recv(4096):
                buf.extend(data)

    def received(self) -> list[bytes]:
        return [bytes(b) for b in self.got]


def test_a_partition_stalls_open_connections_refuses_new_ones_and_heals():
    topo = mr.Topology(["cut", "other"])
    r, other = topo.region("cut"), topo.region("other")
    collector = _Collector("0.0.0.0")
    client = subprocess.Popen(
        ["ip", "netns", "exec", r.ns, sys.executable, "-c", _PARTITION_CLIENT, r.host_ip, str(collector.port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert client.stdout.readline().strip() == "connected"
        wait_for(lambda: collector.received() == [b"a"], 10, "the first byte over the open connection")
        topo.partition("cut")
        assert r.partitioned and not other.partitioned
        client.stdin.write("\n")
        client.stdin.flush()
        # A new connection fails at once (no route), not after its timeout.
        t0 = time.monotonic()
        assert client.stdout.readline().strip() == "new connection: Network is unreachable"
        assert time.monotonic() - t0 < 4
        # What the open connection sent stays in the region while it is cut off.
        assert poll_until(lambda: collector.received()[0] != b"a", 1.5) is None
        # The other region is not cut off.
        subprocess.run(["ip", "netns", "exec", other.ns, sys.executable, "-c",
                        f"import socket; socket.create_connection(('{other.host_ip}', {collector.port}), timeout=5).sendall(b'o')"],
                       check=True, timeout=30)
        wait_for(lambda: b"o" in collector.received(), 10, "a connection from the other region")
        assert collector.received()[0] == b"a"
        topo.heal("cut")
        assert not r.partitioned
        client.stdin.write("\n")
        client.stdin.flush()
        client.wait(timeout=60)
        assert client.returncode == 0
        # The stalled byte arrives on the connection it was sent on, and a new connection goes through.
        wait_for(lambda: collector.received()[0] == b"ab" and b"c" in collector.received(), 60,
                 "the stalled byte and a new connection after the heal")
    finally:
        stop_processes([client], 5)
        collector.srv.close()
        topo.close()
    assert not Path(f"/var/run/netns/{r.ns}").exists()


_STALLED_CLIENT = """
import json, sys, threading, time
from sqlalchemy import text
from ddiloco.platform.ledger.engine import make_engine
from ddiloco.platform.store import FragmentStore

engine, store = make_engine(sys.argv[1]), FragmentStore(sys.argv[2])
big = int(sys.argv[3])
out = {}

def timed(name, op):
    t0 = time.monotonic()
    try:
        op()
        out[name] = ["ok", time.monotonic() - t0]
    except Exception as err:
        out[name] = [type(err).__name__, time.monotonic() - t0]

def ledger():
    with engine.connect() as c:
        c.execute(text("SELECT 1"))

def upload(n):
    return lambda: store.fs.pipe(f"{store.root}/blob-{n}", b"x" * n)

timed("ledger", ledger)  # the pooled connection that the cut will stall
timed("store", upload(1))
print(json.dumps(out), flush=True)
# An upload in flight when the cut comes (the test cuts once its bytes cross the link), and a query on the pooled
# connection once the region is cut off.
uploading = threading.Thread(target=timed, args=("store", upload(big)))
uploading.start()
sys.stdin.readline()  # the region is cut off now
timed("ledger", ledger)
uploading.join()
print(json.dumps(out), flush=True)
sys.stdin.readline()  # healed
timed("ledger", ledger)
timed("store", upload(2))
print(json.dumps(out), flush=True)
"""


def test_a_connection_stalled_by_a_cut_is_dropped_within_the_stall_bound_and_a_new_one_works_after_the_heal(postgres_url):
    """The ledger's and the store's connections do not wait out TCP's backoff: a query on a pooled connection and an
    upload in flight that the cut stalled fail within ``platform.stall.STALL_TIMEOUT_S`` while the cut lasts, and the
    next ones after the heal go through on new connections (left alone, a stalled connection resumes at TCP's next
    retransmission, after the heal, and the longer the cut the longer after it)."""
    import json

    from ddiloco.platform.stall import STALL_TIMEOUT_S

    with tempfile.TemporaryDirectory(prefix="mr-stall-") as tmp, mr.Lab(["st"], postgres_url, Path(tmp)) as lab:
        # A 2 Mbit/s link, so an 8 MB upload is still in flight (32 s) when the cut comes, however slowly this test runs.
        lab.set_network(2.0, [0.0])
        region = lab.topo.region("st")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DDILOCO_", "AWS_"))}
        env.update(lab.region_env(region))
        # botocore retries a failed request itself (with backoff): one attempt, so what is timed is the stalled one.
        env["AWS_MAX_ATTEMPTS"] = "1"
        client = subprocess.Popen(
            [*mr.region_wrap(region), sys.executable, "-c", _STALLED_CLIENT, env.pop("DDILOCO_LEDGER__URL"),
             f"s3://{lab.bucket}", str(8 << 20)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        lines: list[dict] = []

        def read() -> None:
            for line in client.stdout:
                lines.append(json.loads(line))

        threading.Thread(target=read, daemon=True).start()
        try:
            wait_for(lambda: lines, 60, "the client's first ledger query and upload")
            assert lines[0]["ledger"][0] == "ok" and lines[0]["store"][0] == "ok", lines
            up = lab.topo.counters()["st"]["up"]
            wait_for(lambda: lab.topo.counters()["st"]["up"] > up + (256 << 10), 30, "the big upload's bytes to cross the link")
            lab.topo.partition("st")
            client.stdin.write("\n")
            client.stdin.flush()
            # Both fail while the region is still cut off, within the bound (and the slack of a loaded machine).
            wait_for(lambda: len(lines) > 1, 3 * STALL_TIMEOUT_S, "the stalled query and upload to fail")
            cut = lines[1]
            assert cut["ledger"][0] != "ok" and cut["store"][0] != "ok", cut
            assert cut["ledger"][1] < 2 * STALL_TIMEOUT_S, cut
            assert cut["ledger"][1] >= 0.5 * STALL_TIMEOUT_S, cut  # it did stall, then was dropped
            lab.topo.heal("st")
            client.stdin.write("\n")
            client.stdin.flush()
            wait_for(lambda: len(lines) > 2, 3 * STALL_TIMEOUT_S, "a ledger query and an upload after the heal")
            healed = lines[2]
            assert healed["ledger"][0] == "ok" and healed["store"][0] == "ok", healed
            assert max(healed["ledger"][1], healed["store"][1]) < STALL_TIMEOUT_S, healed
            client.wait(timeout=30)
            assert client.returncode == 0
        finally:
            lab.topo.heal("st")
            stop_processes([client], 5)


def test_relay_adds_the_one_way_delay_each_way():
    with EchoServer() as echo:
        port = free_port()
        relay = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddiloco.testing.relay",
                f"127.0.0.1:{port}=127.0.0.1:{echo.port}@100",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert "relay ready" in relay.stdout.readline()
            with socket.create_connection(("127.0.0.1", port)) as c:
                rtts = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    c.sendall(b"ping")
                    assert c.recv(16) == b"ping"
                    rtts.append(time.perf_counter() - t0)
                # Bandwidth is not capped by the delay: 4 MB through the relay well within one second.
                t0 = time.perf_counter()
                c.sendall(b"y" * 4_000_000)
                got = 0
                while got < 4_000_000:
                    got += len(c.recv(1 << 20))
                bulk_s = time.perf_counter() - t0
        finally:
            stop_processes([relay], 5)
    assert min(rtts) >= 0.2, f"100 ms each way must give a round trip >= 200 ms, got {min(rtts) * 1e3:.0f} ms"
    assert max(rtts) < 1.0
    assert bulk_s < 1.5, f"4 MB took {bulk_s:.2f} s through the relay: the delay caps bandwidth"


def test_learner_in_a_region_namespace_submits_through_the_shaped_link(postgres_url):
    from sqlalchemy import select

    from ddiloco.entry import ProcessSpec
    from ddiloco.platform.config import build_config
    from ddiloco.platform.ledger import runs as runs_q
    from ddiloco.platform.ledger.models import Submission
    from ddiloco.platform.store import FragmentStore
    from ddiloco.testing.processes import ProcessCluster, watcher_context, write_config

    with tempfile.TemporaryDirectory(prefix="mr-test-") as tmp, mr.Lab(["us"], postgres_url, Path(tmp)) as lab:
        lab.set_network(20.0, [40.0])
        region = lab.topo.regions[0]
        run_id = "mr-test"
        data = mr.bench_config(run_id, lab.ledger_url, lab.bucket, ["us"], 1, quick=True)
        data["synchronizer"]["retention"] = {"keep_submission_blobs": True}  # so the test can read them back
        cfg = build_config(data)
        cfg_path = write_config(cfg, Path(tmp) / "cfg.yaml")
        ctx = watcher_context(cfg, run_id)
        before = lab.topo.counters()["us"]
        cluster = ProcessCluster(
            cfg_path, run_id, Path(tmp), env={k: v for k, v in os.environ.items() if not k.startswith(("DDILOCO_", "AWS_"))}
        )
        cluster.synchronizer("sync", env={**lab.aws_env, "AWS_ENDPOINT_URL": lab.s3_url})
        learner = cluster.start("us-0", ProcessSpec.learner("us-0", max_steps=40), env=lab.region_env(region), wrap=mr.region_wrap(region))
        try:
            learner.wait(timeout=150)
            with ctx.reading() as s:
                row = {r.id: r for r in runs_q.learners(s, run_id)}.get("us-0")
                subs = s.execute(
                    select(Submission.blob_key, Submission.sha256, Submission.nbytes).where(
                        Submission.run_id == run_id, Submission.learner_id == "us-0"
                    )
                ).all()
            after = lab.topo.counters()["us"]
            log_tail = cluster.log("us-0")[-2000:]
            assert learner.returncode == 0, log_tail
            assert row is not None and row.step >= 40, log_tail
            assert subs, "the learner submitted nothing"
            store = FragmentStore(cfg.storage.url, lab.storage_options)
            assert all(store.verify(key, sha) for key, sha, _ in subs[:5])
            # The blobs went out through the region's veth: it carried at least their bytes upward.
            assert after["up"] - before["up"] >= sum(n for _, _, n in subs)
            assert after["down"] - before["down"] > 0  # the global fragments came down the same link
        finally:
            cluster.stop_all(20)
            ctx.engine.dispose()
    assert not Path(f"/var/run/netns/{region.ns}").exists()


def _scrape_in(r: mr.Region, port: int) -> dict[str, float]:
    """``{name{labels}: value}`` of a learner's /metrics inside region r's namespace (reachable while the region is cut
    off: it is the namespace's own loopback), or {} while nothing answers."""
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=10).read().decode())"
    res = subprocess.run(["ip", "netns", "exec", r.ns, sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         check=False)
    return _samples(res.stdout) if res.returncode == 0 else {}


def _samples(text: str) -> dict[str, float]:
    """``{name{labels}: value}`` of every sample of a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f"{s.name}{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))}}}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _scrape(port: int) -> dict[str, float]:
    """The samples at 127.0.0.1:port/metrics of the root namespace, or {} while nothing answers."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return _samples(resp.read().decode())
    except OSError:
        return {}


def test_a_region_cut_off_trains_on_shows_as_cut_off_and_loses_no_token_when_it_heals(postgres_url):
    from datetime import datetime, timezone

    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from ddiloco.entry import ProcessSpec
    from ddiloco.platform import invariants, liveness
    from ddiloco.platform.config import build_config, tokens_per_step
    from ddiloco.platform.ledger import open_ledger
    from ddiloco.platform.ledger import reports as reports_q
    from ddiloco.platform.ledger import runs as runs_q
    from ddiloco.platform.ledger import synchronizer as sync_q
    from ddiloco.platform.ledger.models import MERGED, REJECTED, Heartbeat, Submission
    from ddiloco.platform.runtime import RunContext
    from ddiloco.platform.store import FragmentStore
    from ddiloco.synchronizer.validate import DEAD_LEARNER
    from ddiloco.testing.processes import ProcessCluster, write_config
    from ddiloco.ui import queries as uq

    learners = ["eu-0", "eu-1"]
    with tempfile.TemporaryDirectory(prefix="mr-cut-") as tmp, mr.Lab(["eu"], postgres_url, Path(tmp)) as lab:
        lab.set_network(None, [0.0])  # the cut is the only fault
        region = lab.topo.region("eu")
        run_id = "mr-cut"
        data = mr.bench_config(run_id, lab.ledger_url, lab.bucket, ["eu"], len(learners), quick=True)
        # Dead soon, so the cut outlasts the liveness rule within seconds; a session frozen mid-transaction by the
        # cut is ended by the server before its learner's verdict.
        data["learners"].update(dead_after_s=3.0, heartbeat_s=0.5, poll_s=0.25)
        data["ledger"]["idle_in_transaction_timeout_s"] = 2.0
        # The tiny model steps hundreds of times a second: paced and sending less often, the learners leave this
        # 2-core machine to the synchronizer, which must keep up well within dead_after_s.
        data["learners"]["regions"][0]["speeds"] = [0.25] * len(learners)
        data["fragments"]["every"] = 32
        cfg = build_config(data)
        cfg_path = write_config(cfg, Path(tmp) / "cfg.yaml")
        # The test's own reads run without the processes' 2 s idle-in-transaction bound: on a loaded machine a reader
        # paused between two statements of its snapshot would be ended by the server (it was once, at load ~10).
        ctx = RunContext.open(cfg, run_id, engine=open_ledger(cfg.ledger.url))
        ro = uq.read_only_engine(lab.ledger_url)
        cluster = ProcessCluster(
            cfg_path, run_id, Path(tmp), env={k: v for k, v in os.environ.items() if not k.startswith(("DDILOCO_", "AWS_"))}
        )
        sync_port, learner_port = free_port(), 9100  # the learners' port is on their namespace's own loopback
        cut_gauge = f"ddiloco_region_cut_off{{region=eu,run={run_id}}}"

        def merged_since(when: datetime) -> dict[str, int]:
            """How many submissions of each learner created after ``when`` are merged."""
            with ctx.reading() as s:
                rows = s.execute(select(Submission.learner_id).where(
                    Submission.run_id == run_id, Submission.status == MERGED, Submission.created_at > when)).scalars().all()
            return {lid: rows.count(lid) for lid in learners}

        def view(now: datetime) -> uq.RunPage:
            with Session(ro) as s:
                return uq.run_page(s, run_id, now)

        started = datetime.now(timezone.utc)
        cluster.synchronizer("sync", env={**lab.aws_env, "AWS_ENDPOINT_URL": lab.s3_url, "DDILOCO_METRICS_PORT": f"127.0.0.1:{sync_port}"})
        for i, lid in enumerate(learners):
            cluster.start(lid, ProcessSpec.learner(lid),
                          env={**lab.region_env(region), "DDILOCO_METRICS_PORT": f"127.0.0.1:{learner_port + i}"},
                          wrap=mr.region_wrap(region))
        learner_port_of = {lid: learner_port + i for i, lid in enumerate(learners)}

        def steps() -> dict[str, float]:
            return {lid: _scrape_in(region, learner_port_of[lid]).get(f"ddiloco_learner_step{{learner={lid},run={run_id}}}", -1)
                    for lid in learners}

        try:
            wait_for(lambda: all(merged_since(started).values()), 150, "a merged submission of each learner before the cut",
                     interval_s=0.5)
            wait_for(lambda: _scrape(sync_port).get(cut_gauge) == 0, 15, "the synchronizer's gauge to say eu is not cut off")

            lab.topo.partition("eu")
            cut_at = datetime.now(timezone.utc)
            before = wait_for(lambda: (st := steps()) and min(st.values()) >= 0 and st, 30, "each learner's step at the cut",
                              interval_s=0.5)
            # The region view, as the dashboard reads it, says cut off once the learners outlive the liveness rule.
            page = wait_for(lambda: (p := view(datetime.now(timezone.utc))).snapshot.regions["eu"].status == liveness.CUT_OFF and p,
                            30, "the dashboard's region view to say eu is cut off", interval_s=0.5)
            regions = page.regions.set_index("region")
            assert regions.loc["eu", "status"] == liveness.CUT_OFF and regions.loc["eu", "dead"] == len(learners)
            assert regions.loc["eu", "reason"].startswith(f"all {len(learners)} learners silent since ")
            assert regions.loc["eu", "reason"].endswith("cut off from the ledger?")
            # So does the synchronizer: its gauge, and one event for the cut.
            wait_for(lambda: _scrape(sync_port).get(cut_gauge) == 1, 15, "the synchronizer's gauge to say eu is cut off")
            assert _scrape(sync_port)[f"ddiloco_region_learners{{region=eu,run={run_id},status=dead}}"] == len(learners)
            with ctx.reading() as s:
                assert [e.actor for e in runs_q.events(s, run_id) if e.kind == sync_q.REGION_CUT_OFF] == ["eu"]
            # Meanwhile the learners train on: alive, and stepping past where they were when the region was judged cut off.
            judged = steps()
            trained_in_cut = wait_for(lambda: (st := steps()) and all(st[lid] > max(judged[lid], before[lid]) for lid in learners)
                                      and st, 30, "the cut-off learners to keep stepping", interval_s=0.5)
            assert all(cluster.procs[lid].poll() is None for lid in learners)

            lab.topo.heal("eu")
            healed_at = datetime.now(timezone.utc)
            cut_steps = {lid: trained_in_cut[lid] - before[lid] for lid in learners}

            def sent_since_cut() -> list | None:
                """Every submission registered since the cut, once each learner has sent what it trained while cut off
                and has one merged since the heal. What it trained is coalesced, but not always into one submission:
                an upload taken from the outbox during the cut and still in its retries at the heal goes through with
                the steps it was taken with, and the steps folded in after it go with the next send of that fragment.
                So the steps of some fragment's submissions since the cut add up to at least the steps of the cut."""
                with ctx.reading() as s:
                    sent = s.execute(select(Submission.learner_id, Submission.fragment, Submission.c_steps,
                                            Submission.created_at).where(
                        Submission.run_id == run_id, Submission.created_at > cut_at)).all()
                steps_of: dict[tuple[str, int], int] = {}
                for who, fragment, c, _ in sent:
                    steps_of[who, fragment] = steps_of.get((who, fragment), 0) + c
                carried = all(any(n >= cut_steps[lid] for (who, _), n in steps_of.items() if who == lid) for lid in learners)
                return sent if carried and all(merged_since(healed_at).values()) else None

            # Each learner is heard of again, sends what it held back, and its submissions are merged again.
            try:
                sent = wait_for(sent_since_cut, 60, "each learner's coalesced work sent and a submission merged after the heal",
                                interval_s=0.5)
            except TimeoutError as err:
                # What the run did meanwhile, so that a timeout on a loaded CI machine says why.
                with ctx.reading() as s:
                    rows = s.execute(select(Submission.learner_id, Submission.fragment, Submission.c_steps, Submission.status,
                                            Submission.reject_reason, Submission.created_at).where(
                        Submission.run_id == run_id, Submission.created_at > cut_at).order_by(Submission.id)).all()
                logs = {name: cluster.log(name)[-3000:] for name in ["sync", *learners]}
                raise AssertionError(f"{err}\ncut at {cut_at}, healed at {healed_at}, steps in the cut {cut_steps}, "
                                     f"now {steps()}\nsubmissions since the cut:\n" + "\n".join(map(str, rows)) +
                                     "".join(f"\n--- {name} log ---\n{text}" for name, text in logs.items())) from None
            with ctx.reading() as s:
                beats = s.execute(select(Heartbeat.learner_id, Heartbeat.at).where(
                    Heartbeat.run_id == run_id, Heartbeat.at > cut_at, Heartbeat.at < healed_at)).all()
            # Nothing is stamped with a time inside the cut: what was written after the heal carries the time it was
            # written at, so the heartbeat that ends the cut is not one from before it.
            assert beats == [] and all(at >= healed_at for *_, at in sent), (beats, sent)
            after = wait_for(lambda: (p := view(datetime.now(timezone.utc))).snapshot.regions["eu"].status == liveness.REGION_UP and p,
                             30, "the region view to say eu is up again", interval_s=0.5)
            assert {lid: after.snapshot.verdicts[lid].status for lid in learners} == dict.fromkeys(learners, liveness.ALIVE)
            wait_for(lambda: _scrape(sync_port).get(cut_gauge) == 0, 15, "the synchronizer's gauge to say eu is back")
            # Nothing the learners trained is unaccounted: trained = merged + rejected (each with its reason) + pending +
            # in flight, and nothing lost. No work is refused as a dead learner's: what was registered before the cut is
            # judged as usual even when the synchronizer reaches it after its learner was declared dead.
            with ctx.reading() as s:
                acct = reports_q.token_accounting(s, run_id)
                rejected = s.execute(select(Submission.reject_reason, Submission.created_at).where(
                    Submission.run_id == run_id, Submission.status == REJECTED)).all()
            assert acct.balanced and acct.lost == 0, acct
            assert acct.trained >= sum(trained_in_cut.values()) * tokens_per_step(cfg.model, cfg.learners.batch_size)
            assert all(why for why, _ in rejected), rejected
            assert not [why for why, _ in rejected if why.startswith(DEAD_LEARNER)], rejected
            problems = invariants.check_run(ctx, lambda r: FragmentStore(cfg.storage_url_for(r), lab.storage_options))
            assert problems == [], [str(p) for p in problems]
        finally:
            cluster.stop_all(20)
            ro.dispose()
            ctx.engine.dispose()
    assert not Path(f"/var/run/netns/{region.ns}").exists()
