"""Hosts in network namespaces on one bridge, and the network faults between them.

A :class:`Fabric` is one run's network: a namespace ``edp-R-fab`` holding the bridge ``br0``
and the fabric-side end of every veth, and one namespace per host (``edp-R-n0`` for node 0,
``edp-R-e0`` for etcd member 0, ``edp-R-s3`` for the storage endpoint), each with its own
``eth0`` and an address in ``10.213.0.0/24``. The root namespace gets no address and no route
to them: nothing the tests start is reachable from outside the namespaces they created.

Faults act in the fabric namespace, on the bridge, so neither end's stack sees a local error:

- ``partition``: elements ``src . dst`` of the nft set ``cut`` (table ``bridge edp``) drop every
  IPv4 packet from ``src`` to ``dst``. Every element carries a timeout, so a partition heals by
  itself if the harness dies; :meth:`Fabric.heal` flushes the set.
- ``packet-loss``: a rule per (src, dst) pair dropping ``numgen random mod 100 < P`` of the packets.
- ``bandwidth``: ``tbf`` on the host's fabric port (traffic to the host) and on its ``eth0``
  (traffic from it).
- ``latency``: the kernel has no ``netem``, so an iptables ``NFQUEUE`` rule on the receiving host's INPUT
  (this kernel has the xt target but not nft's ``queue``) hands the packets it gets from chosen peers to
  :mod:`chaos.delayline`, which accepts each one after the delay (``--queue-bypass``: if the delay
  line dies, packets pass undelayed).

Teardown (:meth:`Fabric.close`, also on interpreter exit): for each namespace the harness
created, by name, its processes (``ip netns pids``) get SIGTERM, then SIGKILL, then the name is
deleted; the fabric namespace goes last, taking the bridge, the veths and the nft table with it.
``python -m chaos clean`` removes the namespaces of runs whose owner process is gone.

Needs root and the ``ip`` and ``nft`` commands (Debian ``iproute2`` and ``nftables``):
:func:`unavailable` says why namespaces cannot be used here, or "".
"""

from __future__ import annotations

import atexit
import ctypes
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from chaos.scenario import ChaosError

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
PREFIX = "edp-"
SUBNET = ipaddress.IPv4Network("10.213.0.0/24")
IFNAME = "eth0"
"""Every host's interface; ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` name it."""
OWNER_DIR = Path("/run/edp")
"""``/run/edp/R/owner`` holds the pid of the process that created run R's namespaces."""
PARTITION_TTL_S = 600.0
"""How long a partition lasts if nobody heals it (the harness died): the nft set element's timeout."""
TERM_GRACE_S = 5.0
"""How long processes left in a namespace get between SIGTERM and SIGKILL at teardown."""
_CLONE_NEWNET = 0x40000000

T = TypeVar("T")


class NetnsError(ChaosError):
    """A namespace, link or rule could not be created or removed; the message names it."""


def unavailable() -> str:
    """Why hosts in namespaces cannot run here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "nft", "tc", "iptables") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (Debian: apt-get install iproute2 nftables iptables; scripts/setup.sh does)"
    return ""


def sh(*command: str, input_text: str | None = None, check: bool = True) -> str:
    """Run one command; its stdout. A failure raises NetnsError with the command and its stderr."""
    result = subprocess.run(command, check=False, input=input_text, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetnsError(f"{' '.join(command)}: exit {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def exec_prefix(namespace: str) -> list[str]:
    """The command prefix that runs a program inside ``namespace`` (``ip netns exec`` execs it: same pid)."""
    return ["ip", "netns", "exec", namespace]


def call_in(namespace: str, function: Callable[[], T]) -> T:
    """``function()`` run in a thread that entered ``namespace``: sockets it creates live there (and keep
    working from any thread afterwards). The calling thread's own namespace is untouched."""
    results: list[T] = []
    errors: list[BaseException] = []

    def enter_and_call() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise NetnsError(f"setns into {namespace}: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
            results.append(function())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, which raises it
            errors.append(exc)

    thread = threading.Thread(target=enter_and_call, name=f"netns-{namespace}", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


def namespace_pids(namespace: str) -> list[int]:
    """Pids of the processes in ``namespace`` (``ip netns pids``)."""
    return [int(pid) for pid in sh("ip", "netns", "pids", namespace, check=False).split()]


def existing_namespaces() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list", check=False).splitlines() if line.strip()]


def remove_namespace(namespace: str, grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM every process in ``namespace``, SIGKILL what is left after ``grace_s``, delete the name."""
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        pids = namespace_pids(namespace)
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = namespace_pids(namespace)
        if not pids:
            break
    sh("ip", "netns", "del", namespace, check=False)


@dataclass(frozen=True)
class Host:
    """One namespace with an address on the bridge."""

    name: str
    """Short name: ``n0``, ``e0``, ``s3``, ``ctl``."""
    namespace: str
    address: str
    port: str
    """Its veth's end in the fabric namespace (attached to the bridge)."""


@dataclass
class Fabric:
    """One run's namespaces, bridge and fault rules; see the module docstring."""

    run: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    hosts: dict[str, Host] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)
    delay_lines: dict[str, subprocess.Popen] = field(default_factory=dict)
    """Host name -> its running :mod:`chaos.delayline` (see :meth:`latency`)."""
    closed: bool = False

    @property
    def fab(self) -> str:
        return f"{PREFIX}{self.run}-fab"

    def create(self) -> Fabric:
        """The fabric namespace with its bridge and the nft table; registers teardown at exit."""
        why = unavailable()
        if why:
            raise NetnsError(f"cannot create namespaces: {why}")
        clean_orphans()
        owner = OWNER_DIR / self.run
        owner.mkdir(parents=True, exist_ok=True)
        (owner / "owner").write_text(str(os.getpid()))
        atexit.register(self.close)
        self._add_namespace(self.fab)
        self.in_fab("ip", "link", "add", "br0", "type", "bridge")
        self.in_fab("ip", "link", "set", "br0", "up")
        self.in_fab("ip", "link", "set", "lo", "up")
        sh(*exec_prefix(self.fab), "nft", "-f", "-", input_text=NFT_TABLE)
        return self

    def in_fab(self, *command: str) -> str:
        return sh(*exec_prefix(self.fab), *command)

    def _add_namespace(self, namespace: str) -> None:
        sh("ip", "netns", "add", namespace)
        self.created.append(namespace)

    def add_host(self, name: str) -> Host:
        """A namespace ``edp-R-<name>`` with ``eth0`` on the bridge and the next free address."""
        if name in self.hosts:
            return self.hosts[name]
        address = str(SUBNET.network_address + 10 + len(self.hosts))
        host = Host(name, f"{PREFIX}{self.run}-{name}", address, f"p-{name}")
        self._add_namespace(host.namespace)
        sh("ip", "link", "add", IFNAME, "netns", host.namespace, "type", "veth", "peer", "name", host.port,
           "netns", self.fab)
        self.in_fab("ip", "link", "set", host.port, "master", "br0", "up")
        inside = exec_prefix(host.namespace)
        sh(*inside, "ip", "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", IFNAME)
        sh(*inside, "ip", "link", "set", IFNAME, "up")
        sh(*inside, "ip", "link", "set", "lo", "up")
        self.hosts[name] = host
        logger.info("host %s: namespace %s, address %s", name, host.namespace, address)
        return host

    # -- faults --------------------------------------------------------------------------

    def partition(self, sources: list[str], destinations: list[str], ttl_s: float = PARTITION_TTL_S) -> None:
        """Drop every packet from each source host to each destination host (one direction; call twice
        for a symmetric cut). Heals by itself after ``ttl_s``."""
        pairs = [(self.hosts[a].address, self.hosts[b].address) for a in sources for b in destinations if a != b]
        if not pairs:
            return
        elements = ", ".join(f"{src} . {dst} timeout {int(ttl_s)}s" for src, dst in pairs)
        self.in_fab("nft", "add", "element", "bridge", "edp", "cut", "{ " + elements + " }")

    def unpartition(self, sources: list[str], destinations: list[str]) -> None:
        """Undo :meth:`partition` for these hosts (elements already gone are skipped)."""
        for a in sources:
            for b in destinations:
                if a != b:
                    element = f"{{ {self.hosts[a].address} . {self.hosts[b].address} }}"
                    sh(*exec_prefix(self.fab), "nft", "delete", "element", "bridge", "edp", "cut", element, check=False)

    def heal(self) -> None:
        """Undo every partition and every loss rule."""
        self.in_fab("nft", "flush", "set", "bridge", "edp", "cut")
        self.no_loss()

    def no_loss(self) -> None:
        """Remove every :meth:`packet_loss` rule."""
        self.in_fab("nft", "flush", "chain", "bridge", "edp", "loss")

    def packet_loss(self, sources: list[str], destinations: list[str], percent: float) -> None:
        """Drop ``percent`` % of the packets from each source host to each destination host, at random."""
        chance = [] if percent >= 100 else ["numgen", "random", "mod", "10000", "<", str(round(percent * 100))]
        for a in sources:
            for b in destinations:
                if a != b:
                    self.in_fab("nft", "add", "rule", "bridge", "edp", "loss", "ip", "saddr", self.hosts[a].address,
                                "ip", "daddr", self.hosts[b].address, *chance, "drop")

    def bandwidth(self, name: str, mbit: float) -> None:
        """Limit the host's link to ``mbit`` Mbit/s each way (``tbf`` on both ends of its veth)."""
        rate = f"{mbit}mbit"
        for namespace, device in ((self.fab, self.hosts[name].port), (self.hosts[name].namespace, IFNAME)):
            sh(*exec_prefix(namespace), "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
               "burst", "32kbit", "latency", "400ms")

    def unlimited(self, name: str) -> None:
        """Remove :meth:`bandwidth`'s limits from the host's link."""
        for namespace, device in ((self.fab, self.hosts[name].port), (self.hosts[name].namespace, IFNAME)):
            sh(*exec_prefix(namespace), "tc", "qdisc", "del", "dev", device, "root", check=False)

    def latency(self, name: str, sources: list[str], delay_ms: float, jitter_ms: float = 0.0) -> None:
        """Delay every packet host ``name`` receives from ``sources`` by ``delay_ms`` ± ``jitter_ms`` (uniform):
        an iptables NFQUEUE rule in its namespace (``--queue-bypass``) and :mod:`chaos.delayline` holding the verdicts.
        One direction only, as on a slow inbound link: the round trip to each source grows by ``delay_ms``."""
        self.no_latency(name)
        host = self.hosts[name]
        addresses = ",".join(self.hosts[source].address for source in sources if source != name)
        if not addresses:
            return
        sh(*exec_prefix(host.namespace), "iptables", "-w", "-A", "INPUT", "-s", addresses, "-j", "NFQUEUE",
           "--queue-num", str(DELAY_QUEUE), "--queue-bypass")
        line = subprocess.Popen(
            [*exec_prefix(host.namespace), sys.executable, "-m", "chaos.delayline", str(DELAY_QUEUE),
             str(delay_ms), str(jitter_ms)],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        self.delay_lines[name] = line
        assert line.stdout is not None
        if line.stdout.readline().strip() != "bound":  # it exited: its error is on stderr
            self.no_latency(name)
            raise NetnsError(f"the delay line of {host.namespace} did not bind NFQUEUE {DELAY_QUEUE}")

    def no_latency(self, name: str) -> None:
        """Remove :meth:`latency` from host ``name``: the queue rule first, then the delay line (SIGTERM)."""
        sh(*exec_prefix(self.hosts[name].namespace), "iptables", "-w", "-F", "INPUT", check=False)
        line = self.delay_lines.pop(name, None)
        if line is not None:
            line.terminate()
            try:
                line.wait(timeout=10)
            except subprocess.TimeoutExpired:
                line.kill()
                line.wait()

    def cut_elements(self) -> list[tuple[str, str]]:
        """The (source, destination) addresses currently cut."""
        listing = self.in_fab("nft", "-j", "list", "set", "bridge", "edp", "cut")
        pairs = []
        for item in json.loads(listing)["nftables"]:
            for element in item.get("set", {}).get("elem", []):
                concat = element.get("elem", {}).get("val", element).get("concat", [])
                if len(concat) == 2:
                    pairs.append((concat[0], concat[1]))
        return pairs

    # -- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every namespace this fabric created (hosts first, the fabric last); idempotent."""
        if self.closed:
            return
        self.closed = True
        for name in list(self.delay_lines):
            self.no_latency(name)
        for namespace in [name for name in self.created if name != self.fab] + [self.fab]:
            if namespace in self.created:
                remove_namespace(namespace)
        shutil.rmtree(OWNER_DIR / self.run, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self) -> Fabric:
        return self.create()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


NFT_TABLE = """
table bridge edp {
    set cut {
        type ipv4_addr . ipv4_addr
        flags timeout
    }
    chain loss {
    }
    chain forward {
        type filter hook forward priority 0; policy accept;
        ip saddr . ip daddr @cut drop
        jump loss
    }
}
"""


DELAY_QUEUE = 7
"""The NFQUEUE number of a host's delay line (one per namespace, so one number serves all)."""


def clean_orphans() -> list[str]:
    """Remove the namespaces of runs whose owner process is gone (``/run/edp/R/owner``); their names."""
    removed = []
    runs: dict[str, list[str]] = {}
    for namespace in existing_namespaces():
        parts = namespace.split("-")
        if namespace.startswith(PREFIX) and len(parts) >= 3:
            runs.setdefault(parts[1], []).append(namespace)
    for run, namespaces in runs.items():
        if _owner_alive(run):
            continue
        for namespace in sorted(namespaces, key=lambda name: name.endswith("-fab")):
            remove_namespace(namespace)
            removed.append(namespace)
        shutil.rmtree(OWNER_DIR / run, ignore_errors=True)
    return removed


def _owner_alive(run: str) -> bool:
    try:
        pid = int((OWNER_DIR / run / "owner").read_text())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
