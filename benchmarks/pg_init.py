"""How long a worker takes to reach rank 0's store when that store starts listening late.

Each attempt's rank 0 hosts a fresh TCPStore, and the other ranks usually start before it
listens. Side by side, for each lateness of the server: torch's client alone (it backs off about
500 ms between attempts) and elastic_ddp's way (``distributed.wait_until_listening``: poll the
port every 5 ms, then connect). Prints medians, the spread (min-max) and the ratio.

    .venv/bin/python benchmarks/pg_init.py [--trials 12] [--late-ms 0,50,200]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from chaos.cluster import free_port
from elastic_ddp.distributed import wait_until_listening

HOST = "127.0.0.1"


def connect_time(late_s: float, probe: bool) -> float:
    """Seconds from a client's start to its connected store, the server starting ``late_s`` after it."""
    port = free_port()
    servers: list[dist.TCPStore] = []

    def serve() -> None:
        time.sleep(late_s)
        servers.append(dist.TCPStore(HOST, port, 2, True, timeout=timedelta(seconds=30)))

    thread = threading.Thread(target=serve)
    start = time.monotonic()
    thread.start()
    if probe:
        wait_until_listening(HOST, port, start + 30)
    dist.TCPStore(HOST, port, 2, False, timeout=timedelta(seconds=30))
    took = time.monotonic() - start
    thread.join()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--late-ms", default="0,50,200", help="how late the server starts, comma-separated")
    args = parser.parse_args()
    print(f"{'server late':>11} | {'torch client alone':>26} | {'probe, then connect':>26} | ratio")
    for late_ms in (float(part) for part in args.late_ms.split(",")):
        plain, probed = [], []
        for _ in range(args.trials):  # interleaved, so drift affects both alike
            plain.append(connect_time(late_ms / 1000, probe=False))
            probed.append(connect_time(late_ms / 1000, probe=True))
        a, b = statistics.median(plain), statistics.median(probed)
        print(f"{late_ms:>8.0f} ms | {a * 1000:>7.0f} ms ({min(plain) * 1000:.0f}-{max(plain) * 1000:.0f}) "
              f"| {b * 1000:>7.0f} ms ({min(probed) * 1000:.0f}-{max(probed) * 1000:.0f}) | {b / a:.2f}")


if __name__ == "__main__":
    main()
