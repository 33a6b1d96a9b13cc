"""Parse and validate ``--rdzv-endpoint`` and ``--rdzv-conf`` for the ``etcd-v3`` rendezvous.

Every problem is collected and reported at once, as one :class:`EtcdConfigError`
(a ``ValueError``) that names each bad key and its value. The password is never
echoed.

``--rdzv-conf`` keys:

==========================  ===========================================================
``key_prefix``              etcd key prefix of all rendezvous keys (default
                            ``/elastic_ddp/rdzv/``); the run id is appended.
``ttl``                     seconds the records of the rendezvous (its newest membership, that
                            the job is closed, the exit barrier) outlive their writer's last
                            write or keep-alive (at least 9/10 of it; default 7200). A job that
                            reuses a run id within this time sees the old (e.g. closed) rendezvous.
``read_timeout``            seconds one etcd operation (all endpoints together) and one
                            agent-store wait may take before failing (default 60, or half
                            of ``join_timeout`` if that is shorter; at most half of it: an
                            agent that cannot reach etcd fails its join after one
                            ``read_timeout`` and spends up to another one trying to close
                            the rendezvous on its way out, and both fit in ``join_timeout``).
``cacert``, ``cert``,       PEM files for TLS: the CA that signed the etcd members, and
``key``                     the client certificate and key for mutual TLS.
``user``, ``password``      etcd credentials (both or neither).
``join_timeout``,           torch's ``DynamicRendezvousHandler`` timeouts in seconds
``close_timeout``,          (positive integers, torch's defaults), validated here and
``heartbeat_timeout``       passed to the handler.
``last_call_timeout``       seconds a round stays open for more nodes once ``min_nodes``
                            have joined (default 30, torch's); a positive number, fractions
                            allowed (e.g. ``0.2``; at least 0.01).
``early_close``             ``true`` (default) or ``false``: after the job's first round, a
                            round closes as soon as every live node of the job has joined it
                            (none trains in the previous round any more, none waits as a
                            spare), without waiting for the last call. A node that was not
                            running yet joins in the next round. The first round always
                            waits the last call, so that nodes starting together start together.
``in_process``              ``false`` (default) or ``true`` (a preview): the workers keep their
                            processes when a peer is lost (:mod:`elastic_ddp.membership`); the
                            handler then tells the agent of no waiting node while a worker
                            membership lives, exports where the workers meet
                            (``ELASTIC_DDP_MEMBERSHIP``) and skips the exit barrier. A node that
                            starts workers while that membership lives (a restart, a node added)
                            trains in a round of its own, and its workers join the membership.
``reach_check``             ``true`` (default) or ``false``: once a round completes, every
                            agent connects to the probe listeners (a TCP port on each
                            ``--local-addr``) of the 3 agents after it on the ring of ranks;
                            nodes of a pair that cannot connect are left out (the node with
                            the most cut links first, the higher rank on a tie), step out and
                            re-join once they reach their neighbours again. Catches a node cut
                            off from its peers but not from etcd, which otherwise stalls every round.
``reach_timeout``           seconds one probe connection may take (default 5; fractions
                            allowed): a node that cannot connect within it counts as cut.
                            Covers two lost SYNs (TCP retries after 1 s and 3 s).
``keep_alive_interval``,    seconds between heartbeats, and how many missed heartbeats
``keep_alive_max_attempt``  make a node dead (positive integers, torch's defaults): a node's
                            keys live under an etcd lease of their product's TTL, which each
                            heartbeat keeps alive (no write). A node cut off from etcd longer
                            than that is dropped from the round; it then restarts its workers
                            and re-joins. An outage of etcd itself drops nobody (etcd renews
                            every lease when it elects a leader).
``timeout``                 added by torchrun to every backend's config; the dynamic
                            handler does not read it (use ``join_timeout``).
``connect_timeout``         seconds an agent waits at start-up for the first answer of
                            any etcd member (default 5): with none it fails in one line
                            naming the endpoints, instead of after ``read_timeout``. An
                            outage after that first contact is ridden out as before.
``protocol``                ``http`` or ``https``, as torch's own etcd backends take it
                            (a command line written for them works unchanged);
                            ``https`` turns on TLS like ``https://`` endpoints do.
==========================  ===========================================================
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

from elastic_ddp.rendezvous.client import ClientOptions
from elastic_ddp.rendezvous.errors import EtcdConfigError

DEFAULT_PORT = 2379
DEFAULT_KEY_PREFIX = "/elastic_ddp/rdzv/"
DEFAULT_TTL_S = 7200
DEFAULT_READ_TIMEOUT_S = 60
DEFAULT_CONNECT_TIMEOUT_S = 5
DEFAULT_REACH_TIMEOUT_S = 5.0

# torch's defaults (dynamic_rendezvous.RendezvousTimeout, create_handler); used only
# to check relations between settings the user did not all give.
_TORCH_DEFAULTS = {
    "join_timeout": 600,
    "last_call_timeout": 30,
    "close_timeout": 30,
    "heartbeat_timeout": 5,
    "keep_alive_interval": 5,
    "keep_alive_max_attempt": 3,
}
_OWN_KEYS = (
    "key_prefix", "ttl", "read_timeout", "connect_timeout", "cacert", "cert", "key", "user", "password", "early_close",
    "reach_check", "reach_timeout", "in_process",
)
_FRACTIONAL = frozenset({"last_call_timeout"})
MIN_LAST_CALL_S = 0.01
_LAUNCHER_KEYS = ("timeout",)
_TORCH_ETCD_KEYS = ("protocol",)
KNOWN_KEYS = frozenset(_OWN_KEYS) | frozenset(_TORCH_DEFAULTS) | frozenset(_LAUNCHER_KEYS) | frozenset(_TORCH_ETCD_KEYS)
_UNSIGNED_INT = re.compile(r"^\s*\d+\s*$")
_UNSIGNED_NUMBER = re.compile(r"^\s*(\d+(\.\d*)?|\.\d+)\s*$")
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass(frozen=True, kw_only=True)
class EtcdRendezvousSettings:
    """Everything the ``etcd-v3`` backend, store and handler need, validated."""

    endpoints: tuple[str, ...]
    """``host:port`` of each etcd member, tried in this order."""
    run_id: str
    """torchrun's ``--rdzv-id``; part of every key."""
    key_prefix: str = DEFAULT_KEY_PREFIX
    """Prefix of all keys, ending in ``/``."""
    ttl: int = DEFAULT_TTL_S
    """Seconds the state and store keys live after their lease was last refreshed."""
    connect_timeout: int = DEFAULT_CONNECT_TIMEOUT_S
    """Seconds an agent waits at start-up for the first answer of any etcd member; without one it
    fails with :class:`EtcdConnectionError` naming the endpoints."""
    read_timeout: int = DEFAULT_READ_TIMEOUT_S
    """Deadline in seconds of one etcd operation across all endpoints; also the agent store's timeout.
    When it expires the operation raises ``RendezvousConnectionError`` (store: ``DistStoreError``).
    An etcd outage shorter than this is ridden out by every call, including the agent's poll for
    waiting nodes while its workers train; a longer one fails the agent."""
    use_tls: bool = False
    """Whether the endpoints were given as ``https://``."""
    ca_cert: str | None = None
    """CA bundle that verifies the members (``cacert``)."""
    cert: str | None = None
    """Client certificate for mutual TLS."""
    key: str | None = None
    """Private key of ``cert``."""
    user: str | None = None
    """etcd user."""
    password: str | None = field(default=None, repr=False)
    """Password of ``user``; never logged."""
    join_timeout: int = _TORCH_DEFAULTS["join_timeout"]
    """Seconds a rendezvous may take to complete; then ``next_rendezvous`` raises
    ``RendezvousTimeoutError`` and the agent exits."""
    last_call_timeout: float = _TORCH_DEFAULTS["last_call_timeout"]
    """Seconds a round stays open for more nodes once ``min_nodes`` have joined (fractions allowed)."""
    early_close: bool = True
    """Whether a round after the job's first closes once every live node has joined it (see the module docstring)."""
    reach_check: bool = True
    """Whether every completed round is checked for nodes that cannot reach each other (see the module docstring)."""
    in_process: bool = False
    """Whether the workers keep their processes through a peer's loss (see the module docstring)."""
    reach_timeout: float = DEFAULT_REACH_TIMEOUT_S
    """Seconds one probe connection of the reachability check may take."""
    close_timeout: int = _TORCH_DEFAULTS["close_timeout"]
    """Seconds marking the rendezvous closed may take (job end, agent shutdown)."""
    heartbeat_timeout: int = _TORCH_DEFAULTS["heartbeat_timeout"]
    """Seconds one keep-alive heartbeat may take; a late one is logged and skipped."""
    keep_alive_interval: int = _TORCH_DEFAULTS["keep_alive_interval"]
    """Seconds between a node's heartbeats."""
    keep_alive_max_attempt: int = _TORCH_DEFAULTS["keep_alive_max_attempt"]
    """Missed heartbeats after which a node counts as dead and is removed from the round; a node
    that was removed while alive (its heartbeats could not reach etcd) re-joins."""

    @property
    def run_prefix(self) -> str:
        """Prefix of every key of this run: ``<key_prefix><run_id>/``."""
        return "%s%s/" % (self.key_prefix, self.run_id)

    def rendezvous_timeout(self) -> RendezvousTimeout:
        """The timeouts of torch's ``DynamicRendezvousHandler``."""
        return RendezvousTimeout(
            join=timedelta(seconds=self.join_timeout),
            last_call=timedelta(seconds=self.last_call_timeout),
            close=timedelta(seconds=self.close_timeout),
            heartbeat=timedelta(seconds=self.heartbeat_timeout),
        )

    def client_options(self) -> ClientOptions:
        """Connection settings for :class:`~elastic_ddp.rendezvous.client.GrpcEtcdClient`."""
        return ClientOptions(
            endpoints=self.endpoints,
            request_timeout=float(self.read_timeout),
            ca_cert=self.ca_cert,
            cert=self.cert,
            key=self.key,
            use_tls=self.use_tls,
            user=self.user,
            password=self.password,
        )

    @classmethod
    def from_config(cls, endpoint: str, run_id: str, config: Mapping[str, Any]) -> EtcdRendezvousSettings:
        """Validate torchrun's endpoint, run id and ``--rdzv-conf`` mapping.

        Raises:
            EtcdConfigError: listing every invalid or unknown key with its value.
        """
        issues: list[str] = []
        endpoints, use_tls = parse_endpoints(endpoint, issues)
        use_tls = _protocol(config, endpoint, use_tls, issues)
        _check_run_id(run_id, issues)
        _check_unknown_keys(config, issues)
        ints: dict[str, Any] = {
            name: (_positive_number if name in _FRACTIONAL else _positive_int)(config, name, default, issues)
            for name, default in _TORCH_DEFAULTS.items()
        }
        ttl = _positive_int(config, "ttl", DEFAULT_TTL_S, issues)
        connect_timeout = _positive_int(config, "connect_timeout", DEFAULT_CONNECT_TIMEOUT_S, issues)
        read_timeout = _read_timeout(config, ints["join_timeout"], issues)
        _check_ttl(config, ttl, ints, issues)
        tls: dict[str, Any] = _tls_files(config, issues)
        user, password = _credentials(config, issues)
        key_prefix = _key_prefix(config, issues)
        early_close = _boolean(config, "early_close", True, issues)
        reach_check = _boolean(config, "reach_check", True, issues)
        in_process = _boolean(config, "in_process", False, issues)
        reach_timeout = _positive_number(config, "reach_timeout", DEFAULT_REACH_TIMEOUT_S, issues)
        if issues:
            raise EtcdConfigError(
                "invalid etcd-v3 rendezvous settings (--rdzv-endpoint/--rdzv-conf):\n  " + "\n  ".join(issues)
            )
        return cls(
            endpoints=endpoints,
            run_id=run_id,
            key_prefix=key_prefix,
            ttl=ttl,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            use_tls=use_tls,
            user=user,
            password=password,
            early_close=early_close,
            reach_check=reach_check,
            reach_timeout=reach_timeout,
            in_process=in_process,
            **tls,
            **ints,
        )


def parse_endpoints(endpoint: str, issues: list[str]) -> tuple[tuple[str, ...], bool]:
    """Split ``host[:port][,host[:port]...]`` (optionally ``http://``/``https://``) into endpoints.

    Returns the ``host:port`` targets and whether TLS was asked for with ``https://``.
    """
    entries = [entry.strip() for entry in (endpoint or "").split(",") if entry.strip()]
    if not entries:
        issues.append("--rdzv-endpoint is empty; give host:port[,host:port...] of the etcd members")
        return (), False
    parsed = [_parse_endpoint(entry, issues) for entry in entries]
    schemes = {scheme for _, scheme in parsed if scheme}
    if len(schemes) > 1:
        issues.append("--rdzv-endpoint=%s mixes http:// and https:// members" % endpoint)
    return tuple(target for target, _ in parsed if target), schemes == {"https"}


def _protocol(config: Mapping[str, Any], endpoint: str, use_tls: bool, issues: list[str]) -> bool:
    """Whether to use TLS, given torch's ``protocol`` key (if any) beside the endpoints' schemes."""
    if "protocol" not in config:
        return use_tls
    protocol = str(config["protocol"]).strip().lower()
    if protocol not in ("http", "https"):
        issues.append("--rdzv-conf protocol=%r must be http or https" % config["protocol"])
        return use_tls
    schemes = {entry.rpartition("://")[0].strip().lower() for entry in (endpoint or "").split(",") if "://" in entry}
    if schemes - {protocol}:
        issues.append("--rdzv-conf protocol=%s contradicts the scheme of --rdzv-endpoint=%s" % (protocol, endpoint))
    return protocol == "https"


def _parse_endpoint(entry: str, issues: list[str]) -> tuple[str, str]:
    scheme, _, rest = entry.rpartition("://")
    scheme = scheme.lower()  # URL schemes are case-insensitive (and torch's etcd backends lowercase them)
    if scheme not in ("", "http", "https"):
        issues.append("--rdzv-endpoint entry %r: scheme must be http:// or https://" % entry)
        return "", scheme
    try:
        parts = urlsplit("//" + rest)
        host, port = parts.hostname, parts.port or DEFAULT_PORT
    except ValueError:
        host, port = None, 0
    if not host or parts.path or not 0 < port < 65536:
        issues.append("--rdzv-endpoint entry %r is not host[:port]" % entry)
        return "", scheme
    return ("[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)), scheme


def _check_run_id(run_id: str, issues: list[str]) -> None:
    if not run_id or "/" in run_id or run_id != run_id.strip():
        issues.append("--rdzv-id=%r must be non-empty, without '/' or surrounding spaces" % run_id)


def _check_unknown_keys(config: Mapping[str, Any], issues: list[str]) -> None:
    unknown = sorted(set(config) - KNOWN_KEYS)
    if unknown:
        issues.append(
            "unknown --rdzv-conf key(s) %s; known keys: %s" % (", ".join(unknown), ", ".join(sorted(KNOWN_KEYS)))
        )


def _positive_int(config: Mapping[str, Any], name: str, default: int, issues: list[str]) -> int:
    value = config.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not _UNSIGNED_INT.match(str(value)) or int(value) <= 0:
        issues.append("%s=%r must be a positive integer" % (name, value))
        return default
    return int(value)


def _positive_number(config: Mapping[str, Any], name: str, default: float, issues: list[str]) -> float:
    value = config.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not _UNSIGNED_NUMBER.match(str(value)) or float(value) < MIN_LAST_CALL_S:
        issues.append("%s=%r must be a number of seconds, at least %s" % (name, value, MIN_LAST_CALL_S))
        return default
    return float(value)


def _boolean(config: Mapping[str, Any], name: str, default: bool, issues: list[str]) -> bool:
    value = config.get(name)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    parsed = _BOOLEANS.get(str(value).strip().lower())
    if parsed is None:
        issues.append("%s=%r must be true or false" % (name, value))
        return default
    return parsed


def _read_timeout(config: Mapping[str, Any], join_timeout: int, issues: list[str]) -> int:
    """At most half the join timeout: an unreachable etcd fails the join after one read timeout,
    and torchrun's attempt to close the rendezvous on the way out takes up to one more."""
    if config.get("read_timeout") is None:
        return max(1, min(DEFAULT_READ_TIMEOUT_S, join_timeout // 2))
    read_timeout = _positive_int(config, "read_timeout", DEFAULT_READ_TIMEOUT_S, issues)
    if 2 * read_timeout > join_timeout:
        issues.append(
            "read_timeout=%d exceeds half of join_timeout=%d: an agent that cannot reach etcd fails its "
            "join after one read_timeout and tries to close the rendezvous for up to another one, and "
            "must exit within join_timeout" % (read_timeout, join_timeout)
        )
    return read_timeout


def _check_ttl(config: Mapping[str, Any], ttl: int, ints: Mapping[str, int], issues: list[str]) -> None:
    liveness = ints["keep_alive_interval"] * ints["keep_alive_max_attempt"]
    if ttl <= liveness:
        issues.append(
            "ttl=%r must exceed keep_alive_interval*keep_alive_max_attempt=%d, or live rendezvous state expires"
            % (config.get("ttl", ttl), liveness)
        )


def _tls_files(config: Mapping[str, Any], issues: list[str]) -> dict[str, str | None]:
    files = {"ca_cert": config.get("cacert"), "cert": config.get("cert"), "key": config.get("key")}
    for option, path in zip(("cacert", "cert", "key"), files.values()):
        if path is not None and not os.access(str(path), os.R_OK):
            issues.append("%s=%r is not a readable file" % (option, path))
    if (files["cert"] is None) != (files["key"] is None):
        issues.append("cert and key must be given together (cert=%r, key=%r)" % (files["cert"], files["key"]))
    return {name: (str(path) if path is not None else None) for name, path in files.items()}


def _credentials(config: Mapping[str, Any], issues: list[str]) -> tuple[str | None, str | None]:
    user, password = config.get("user"), config.get("password")
    if (user is None) != (password is None):
        issues.append("user and password must be given together (user=%r, password %s)"
                      % (user, "set" if password is not None else "missing"))
    if user is not None and not str(user):
        issues.append("user='' must not be empty")
    return (str(user) if user is not None else None), (str(password) if password is not None else None)


def _key_prefix(config: Mapping[str, Any], issues: list[str]) -> str:
    prefix = str(config.get("key_prefix", DEFAULT_KEY_PREFIX))
    if not prefix.startswith("/") or any(ch.isspace() for ch in prefix):
        issues.append("key_prefix=%r must start with '/' and contain no whitespace" % prefix)
    return prefix if prefix.endswith("/") else prefix + "/"
