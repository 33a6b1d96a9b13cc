"""How long a worker takes to reach rank 0's store once that store starts listening.

Each attempt's rank 0 hosts a fresh TCPStore, and the other ranks usually start before it
listens. Side by side, interleaved: torch's client alone (it backs off about 500 ms between
refused attempts) and elastic_ddp's way (``distributed.wait_until_listening``: poll the port every
5 ms, then connect). The store is hosted by another process, as rank 0's worker hosts it; the
figure is the time from the moment that process creates its store to the client's connected
store (wall clock, one machine). Prints medians, the spread (min-max) and the ratio.

    .venv/bin/python benchmarks/pg_init.py [--trials 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from chaos.cluster import free_port
from elastic_ddp.distributed import wait_until_listening

HOST = "127.0.0.1"
SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
print(time.time(), flush=True)  # the store is created now
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, timeout=timedelta(seconds=60))
store.get("done")
"""


def connect_delay(probe: bool) -> float:
    """Seconds from the server process creating its store to this client being connected to it."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        if probe:
            wait_until_listening(HOST, port, time.monotonic() + 60)
        client = dist.TCPStore(HOST, port, 2, False, timeout=timedelta(seconds=60))
        connected = time.time()
        assert server.stdout is not None
        created = float(server.stdout.readline())
        client.set("done", "1")
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return connected - created


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    plain, probed = [], []
    for _ in range(args.trials):  # interleaved, so drift affects both alike
        plain.append(connect_delay(probe=False))
        probed.append(connect_delay(probe=True))
    a, b = statistics.median(plain), statistics.median(probed)
    print(f"store created -> client connected, {args.trials} trials each (median, min-max):")
    print(f"  torch client alone:    {a * 1000:6.0f} ms ({min(plain) * 1000:.0f}-{max(plain) * 1000:.0f})")
    print(f"  probe, then connect:   {b * 1000:6.0f} ms ({min(probed) * 1000:.0f}-{max(probed) * 1000:.0f})")
    print(f"  ratio probe/alone:     {b / a:.2f}")


if __name__ == "__main__":
    main()
