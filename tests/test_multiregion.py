"""The multi-region benchmark's machinery (benchmarks/multiregion.py), checked for real:

- a tbf-shaped veth link between a network namespace and the root namespace really limits a transfer;
- the user-space delay relay (this kernel has no netem) really adds its one-way delay each way;
- cutting a region off (both veth ends down) stalls its open TCP connections and refuses new ones until it heals;
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

from ddiloco.testing.net import free_port, poll_until, wait_for
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


def test_relay_adds_the_one_way_delay_each_way():
    with socket.socket() as echo:
        echo.bind(("127.0.0.1", 0))
        echo.listen(1)

        def serve() -> None:
            conn, _ = echo.accept()
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

        threading.Thread(target=serve, daemon=True).start()
        port = free_port()
        relay = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddiloco.testing.relay",
                f"127.0.0.1:{port}=127.0.0.1:{echo.getsockname()[1]}@100",
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
    from ddiloco.platform.runtime import RunContext
    from ddiloco.platform.store import FragmentStore
    from ddiloco.testing.processes import ProcessCluster, write_config

    with tempfile.TemporaryDirectory(prefix="mr-test-") as tmp, mr.Lab(["us"], postgres_url, Path(tmp)) as lab:
        lab.set_network(20.0, [40.0])
        region = lab.topo.regions[0]
        run_id = "mr-test"
        data = mr.bench_config(run_id, lab.ledger_url, lab.bucket, ["us"], 1, quick=True)
        data["synchronizer"]["retention"] = {"keep_submission_blobs": True}  # so the test can read them back
        cfg = build_config(data)
        cfg_path = write_config(cfg, Path(tmp) / "cfg.yaml")
        ctx = RunContext.open(cfg, run_id)
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
