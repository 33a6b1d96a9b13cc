"""Hosts in network namespaces (chaos.netns): real namespaces, veths, a bridge and nft rules; needs root, ip and nft."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from chaos.etcd import start_etcd
from chaos.netns import (
    OWNER_DIR,
    SUBNET,
    Fabric,
    call_in,
    clean_orphans,
    exec_prefix,
    existing_namespaces,
    namespace_pids,
    unavailable,
)

pytestmark = [pytest.mark.integration, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "available")]

PORT = 5000


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    with Fabric() as made:
        yield made


def listen(fabric: Fabric, name: str) -> socket.socket:
    host = fabric.hosts[name]
    return call_in(host.namespace, lambda: socket.create_server((host.address, PORT)))


def connects(fabric: Fabric, source: str, destination: str) -> bool:
    """Whether a TCP connection from one host to the other completes within 1 s (SYN and SYN-ACK both pass)."""
    address = fabric.hosts[destination].address
    try:
        call_in(fabric.hosts[source].namespace, lambda: socket.create_connection((address, PORT), timeout=1)).close()
        return True
    except OSError:
        return False


def test_hosts_reach_each_other_on_their_own_addresses_and_the_root_namespace_gets_none(fabric: Fabric) -> None:
    fabric.add_host("n0")
    fabric.add_host("n1")
    with listen(fabric, "n1"):
        assert connects(fabric, "n0", "n1")
    assert all(ipaddressed(host.address) for host in fabric.hosts.values())
    root = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert "10.213." not in root


def ipaddressed(address: str) -> bool:
    import ipaddress

    return ipaddress.IPv4Address(address) in SUBNET


def test_a_one_way_partition_drops_one_direction_and_heal_undoes_it(fabric: Fabric) -> None:
    for name in ("n0", "n1"):
        fabric.add_host(name)
    with listen(fabric, "n0"), listen(fabric, "n1"):
        fabric.partition(["n1"], ["n0"])
        assert fabric.cut_elements() == [(fabric.hosts["n1"].address, fabric.hosts["n0"].address)]
        assert not connects(fabric, "n0", "n1")  # the SYN-ACK back is dropped
        assert not connects(fabric, "n1", "n0")
        fabric.heal()
        assert fabric.cut_elements() == []
        assert connects(fabric, "n0", "n1") and connects(fabric, "n1", "n0")


def test_a_partition_between_two_hosts_leaves_the_others_alone(fabric: Fabric) -> None:
    for name in ("n0", "n1", "n2"):
        fabric.add_host(name)
    with listen(fabric, "n1"), listen(fabric, "n2"):
        fabric.partition(["n0"], ["n1"])
        fabric.partition(["n1"], ["n0"])
        assert not connects(fabric, "n0", "n1")
        assert connects(fabric, "n0", "n2")
        fabric.unpartition(["n0"], ["n1"])
        fabric.unpartition(["n1"], ["n0"])
        assert connects(fabric, "n0", "n1")


def test_total_loss_drops_everything_and_removing_the_loss_rules_restores_the_link(fabric: Fabric) -> None:
    for name in ("n0", "n1"):
        fabric.add_host(name)
    with listen(fabric, "n1"):
        fabric.packet_loss(["n0"], ["n1"], 100.0)
        assert not connects(fabric, "n0", "n1")
        fabric.no_loss()
        assert connects(fabric, "n0", "n1")


def test_teardown_kills_what_runs_inside_and_removes_every_namespace_it_made() -> None:
    with Fabric() as fabric:
        host = fabric.add_host("n0")
        child = subprocess.Popen([*exec_prefix(host.namespace), sys.executable, "-c", "import time; time.sleep(600)"])
        deadline = time.monotonic() + 10  # `ip netns exec` enters the namespace, then execs the child (same pid)
        while namespace_pids(host.namespace) != [child.pid]:
            assert time.monotonic() < deadline, "the child never showed in its namespace"
            time.sleep(0.05)
        made = list(fabric.created)
    assert child.wait(timeout=30) != 0
    assert not set(made) & set(existing_namespaces())
    assert not (OWNER_DIR / fabric.run).exists()


def test_the_janitor_removes_namespaces_whose_owner_is_gone_and_keeps_live_ones(fabric: Fabric) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = uuid.uuid4().hex[:6]
    orphan = f"edp-{run}-n0"
    subprocess.run(["ip", "netns", "add", orphan], check=True)
    try:
        (OWNER_DIR / run).mkdir(parents=True, exist_ok=True)
        (OWNER_DIR / run / "owner").write_text(str(dead.pid))
        fabric.add_host("n0")
        assert orphan in clean_orphans()
        assert orphan not in existing_namespaces()
        assert fabric.hosts["n0"].namespace in existing_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", orphan], check=False, capture_output=True)


def test_latency_delays_what_a_host_receives_until_it_is_removed(fabric: Fabric) -> None:
    for name in ("n0", "n1"):
        fabric.add_host(name)
    with listen(fabric, "n1") as server:
        client = call_in(fabric.hosts["n0"].namespace,
                         lambda: socket.create_connection((fabric.hosts["n1"].address, PORT), timeout=5))
        peer, _ = server.accept()
        with client, peer:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            assert round_trip_s(client, peer) < 0.02
            fabric.latency("n1", ["n0"], delay_ms=40)
            assert 0.04 <= round_trip_s(client, peer) < 0.2
            fabric.no_latency("n1")
            assert round_trip_s(client, peer) < 0.02
    assert not fabric.delay_lines


def round_trip_s(client: socket.socket, peer: socket.socket, count: int = 5) -> float:
    """The median time for one byte to go from client to peer and back."""
    import time

    times = []
    for _ in range(count):
        started = time.monotonic()
        client.sendall(b"x")
        peer.sendall(peer.recv(1))
        client.recv(1)
        times.append(time.monotonic() - started)
    return sorted(times)[count // 2]


ETCD_PUT = str(Path(__file__).resolve().parents[1] / "fixtures" / "etcd_put_after_signal.py")
CUT_S = 30.0


@pytest.mark.slow  # the cut must last long enough for TCP's retransmission timer to back off
def test_an_etcd_call_caught_in_a_long_partition_completes_soon_after_the_heal(fabric: Fabric, tmp_path: Path) -> None:
    """A put to etcd sent just after a node lost its link to etcd, with a deadline longer than the cut. TCP
    retransmits the request at doubling intervals (0.2 s ... 25.6 s), so over the same connection it would go
    through about 21 s after a 30 s cut healed; gRPC keep-alive pings declare the dead connection lost, the
    client reconnects, and the put completes within seconds of the heal."""
    with ExitStack() as stack:
        etcd = start_etcd("embedded", tmp_path, stack, fabric=fabric)
        node = fabric.add_host("n0")
        client = subprocess.Popen([*exec_prefix(node.namespace), sys.executable, ETCD_PUT, etcd.endpoint, "90"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        stack.callback(client.wait, 10)
        stack.callback(client.kill)
        assert client.stdin is not None and client.stdout is not None
        assert client.stdout.readline().strip() == "ready"
        fabric.partition(["n0"], ["e0"])
        fabric.partition(["e0"], ["n0"])
        client.stdin.write("1\n")
        client.stdin.flush()
        time.sleep(CUT_S)  # the fault's duration, not a wait for a condition
        fabric.heal()
        healed = time.monotonic()
        answer = client.stdout.readline().strip()
        after_heal = time.monotonic() - healed
        assert not answer.startswith("failed"), answer
        assert after_heal < 12, f"the put completed {after_heal:.1f} s after the heal (it took {answer} s in all)"
