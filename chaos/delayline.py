"""A delay line for packets: latency without ``netem`` (which the project's kernels lack).

An nft rule in a host's namespace sends the packets it receives from chosen peers to NFQUEUE
queue ``N`` (``queue flags bypass``: with no program listening they pass, so a dead delay line
heals instead of partitioning). This program, run inside that namespace, binds the queue over
nfnetlink and gives each packet its ACCEPT verdict ``delay + uniform(-jitter, +jitter)`` ms after
it arrived. Only verdicts are exchanged (the payload is not copied).

Run by :meth:`chaos.netns.Fabric.latency`::

    ip netns exec edp-R-n1 python -m chaos.delayline QUEUE DELAY_MS JITTER_MS

It exits on SIGTERM (the verdicts still held are never given: those packets are dropped, which TCP
retransmits).
"""

from __future__ import annotations

import heapq
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from types import FrameType

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
_NLMSGHDR = struct.Struct("=IHHII")
_NFGENMSG = struct.Struct("=BBH")


def _attribute(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _message(kind: int, queue: int, attributes: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attributes
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, 0, 0) + body


def bind(queue: int) -> socket.socket:
    """A netlink socket bound to NFQUEUE ``queue``, copying packet metadata only."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    command = _attribute(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, socket.AF_INET))
    params = _attribute(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
    sock.send(_message(NFQNL_MSG_CONFIG, queue, command + params, NLM_F_REQUEST | NLM_F_ACK))
    reply = sock.recv(65536)
    length, kind = struct.unpack_from("=IH", reply)
    if kind == NLMSG_ERROR:
        (error,) = struct.unpack_from("=i", reply, _NLMSGHDR.size)
        if error:
            raise OSError(-error, f"binding NFQUEUE {queue}: {os.strerror(-error)}")
    return sock


def packet_ids(data: bytes) -> list[int]:
    """The packet ids of the NFQNL_MSG_PACKET messages in one netlink read."""
    ids, offset = [], 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            position = offset + _NLMSGHDR.size + _NFGENMSG.size
            end = offset + length
            while position + 4 <= end:
                attr_length, attr_kind = struct.unpack_from("=HH", data, position)
                if attr_length < 4:
                    break
                if attr_kind & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, position + 4)[0])
                position += attr_length + (-attr_length % 4)
        offset += length + (-length % 4)
    return ids


def verdict(queue: int, packet_id: int) -> bytes:
    return _message(NFQNL_MSG_VERDICT, queue, _attribute(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id)))


def run(queue: int, delay_s: float, jitter_s: float) -> None:
    """Hold every queued packet for its delay, then accept it; until SIGTERM."""
    sock = bind(queue)
    print("bound", flush=True)  # Fabric.latency waits for this line: from now on every queued packet is delayed
    held: list[tuple[float, int]] = []
    rng = random.Random()
    while True:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, packet_id = heapq.heappop(held)
            sock.send(verdict(queue, packet_id))
        wait = max(0.0, held[0][0] - now) if held else 1.0
        readable, _, _ = select.select([sock], [], [], wait)
        if readable:
            arrived = time.monotonic()
            for packet_id in packet_ids(sock.recv(1 << 20)):
                due = arrived + max(0.0, delay_s + rng.uniform(-jitter_s, jitter_s))
                heapq.heappush(held, (due, packet_id))


def _exit(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit)
    run(int(sys.argv[1]), float(sys.argv[2]) / 1000, float(sys.argv[3]) / 1000)
