"""A user-space TCP relay, its own OS process: ``python -m ddiloco.testing.relay LHOST:LPORT=THOST:TPORT@DELAY_MS ...``.

Each route listens on LHOST:LPORT and forwards every connection to THOST:TPORT, each chunk written DELAY_MS after it
arrived (timestamp-based, so it delays without capping bandwidth). The multi-region benchmark puts it between a
region's namespace and the store and ledger (this kernel has no netem); the soak puts each region's learners behind
one and partitions the region by stopping it (:meth:`Relay.partition`): the kernel still accepts connections, no
byte moves either way, and what was in flight flows again when it heals, as after a real network partition."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Sequence

READY = "relay ready"

MMAP_THRESHOLD = 16384
"""Bytes from which glibc's malloc maps a block of its own, unmapped when freed. A relay's chunks (up to 64 KB) are
freed soon after they arrive; from the heap they left it fragmented after each burst a heal released (twelve bursts of
8 connections of 1-8 MB, each held by a partition and released: 20.1 -> 22.2-22.6 MB, climbing in steps, and
``malloc_trim`` did not return it); mapped, the same bursts left it at 21.3 -> 21.7-21.8 MB from the first on (the
1.2 MB more at the start is ctypes)."""
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _unmap_freed_chunks() -> None:
    """Serve every block of MMAP_THRESHOLD bytes or more from a mapping of its own (glibc; elsewhere nothing)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy reader to writer, each chunk written ``delay_s`` after it was read (reads go on meanwhile)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(maxsize=1024)

    async def pump_in() -> None:
        try:
            while True:
                data = await reader.read(65536)
                await queue.put((loop.time() + delay_s, data))
                if not data:
                    return
        except (ConnectionError, OSError):
            await queue.put((loop.time(), b""))

    feeder = asyncio.create_task(pump_in())
    try:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        feeder.cancel()


async def serve(routes: Sequence[tuple[str, int, str, int, float]]) -> None:
    """Listen on every route's (host, port) and relay to its target with its one-way delay, forever."""

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter, target: tuple[str, int], delay_s: float) -> None:
        try:
            sr, sw = await asyncio.open_connection(*target)
        except OSError:
            cw.close()
            return
        for w in (cw, sw):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(_pipe(cr, sw, delay_s), _pipe(sr, cw, delay_s))
        finally:
            for w in (cw, sw):
                w.close()
            # A line per connection relayed: what crossed a partition, for the logs of whoever runs the relay.
            print(f"{cw.get_extra_info('peername')} -> {target[0]}:{target[1]} closed", flush=True)

    servers = []
    for lhost, lport, thost, tport, delay_s in routes:
        servers.append(
            await asyncio.start_server(lambda r, w, t=(thost, tport), d=delay_s: handle(r, w, t, d), lhost, lport, reuse_address=True)
        )
    print(READY, flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def parse_route(spec: str) -> tuple[str, int, str, int, float]:
    """``LHOST:LPORT=THOST:TPORT@DELAY_MS`` as (lhost, lport, thost, tport, delay in seconds)."""
    listen, rest = spec.split("=", 1)
    target, delay_ms = rest.split("@", 1)
    lh, lp = listen.rsplit(":", 1)
    th, tp = target.rsplit(":", 1)
    return lh, int(lp), th, int(tp), float(delay_ms) / 1e3


def main(argv: Sequence[str]) -> int:
    routes = [parse_route(spec) for spec in argv]
    _unmap_freed_chunks()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        asyncio.run(serve(routes))
    except KeyboardInterrupt:
        pass
    return 0


class Relay:
    """A relay process over ``routes`` (``LHOST:LPORT=THOST:TPORT@DELAY_MS`` each), started ready."""

    def __init__(self, routes: Sequence[str]) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "ddiloco.testing.relay", *routes], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        line = self.process.stdout.readline() if self.process.stdout else ""
        if READY not in line:
            self.stop()
            raise RuntimeError(f"the relay did not start: {line.strip()}")
        self.output: deque[str] = deque(maxlen=100)
        """Its last lines (a line per connection, asyncio's warnings about connections lost mid-write): read as they come, because a relay
        whose pipe filled up would block on its next write and cut every route for good."""
        threading.Thread(target=self._drain, name=f"relay-{self.pid}-output", daemon=True).start()

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)

    @property
    def pid(self) -> int:
        return self.process.pid

    def partition(self) -> None:
        """Cut every route: no byte crosses until :meth:`heal`."""
        self.process.send_signal(signal.SIGSTOP)

    def heal(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        from ddiloco.testing.processes import stop_processes

        stop_processes([self.process], 5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
