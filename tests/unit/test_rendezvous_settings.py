"""--rdzv-endpoint / --rdzv-conf parsing and validation for etcd-v3."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.errors import ConfigError
from elastic_ddp.rendezvous import create_store
from elastic_ddp.rendezvous.errors import EtcdConfigError
from elastic_ddp.rendezvous.settings import EtcdRendezvousSettings


def settings(endpoint: str = "etcd:2379", run_id: str = "job", **conf: object) -> EtcdRendezvousSettings:
    return EtcdRendezvousSettings.from_config(endpoint, run_id, conf)


def test_defaults_with_torchrun_injected_timeout_key() -> None:
    parsed = settings(timeout=900)
    assert parsed.endpoints == ("etcd:2379",)
    assert parsed.key_prefix == "/elastic_ddp/rdzv/"
    assert parsed.run_prefix == "/elastic_ddp/rdzv/job/"
    assert (parsed.ttl, parsed.read_timeout) == (7200, 60)
    assert not parsed.client_options().secure


def test_several_endpoints_get_default_port_and_keep_order() -> None:
    parsed = settings(" h1:2379, h2 ,10.0.0.3:32379,[::1]:2380 ")
    assert parsed.endpoints == ("h1:2379", "h2:2379", "10.0.0.3:32379", "[::1]:2380")


def test_https_endpoints_turn_on_tls() -> None:
    parsed = settings("https://h1:2379,https://h2:2379")
    assert parsed.endpoints == ("h1:2379", "h2:2379")
    assert parsed.client_options().secure


@pytest.mark.parametrize("endpoint", ["", " , ", "h1:notaport", "h1:70000", "ftp://h1:2379", "h1:2379/path"])
def test_bad_endpoint_is_rejected_by_name(endpoint: str) -> None:
    with pytest.raises(EtcdConfigError, match="rdzv-endpoint"):
        settings(endpoint)


def test_mixed_schemes_are_rejected() -> None:
    with pytest.raises(EtcdConfigError, match="mixes"):
        settings("http://h1:2379,https://h2:2379")


@pytest.mark.parametrize(
    "key",
    ["ttl", "read_timeout", "join_timeout", "close_timeout", "heartbeat_timeout",
     "keep_alive_interval", "keep_alive_max_attempt"],
)
@pytest.mark.parametrize("value", ["0", "-5", "1.5", "ten", True])
def test_non_positive_or_non_integer_values_are_named(key: str, value: object) -> None:
    with pytest.raises(EtcdConfigError) as info:
        settings(**{key: value})
    assert "%s=%r must be a positive integer" % (key, value) in str(info.value)


@pytest.mark.parametrize("value", ["0", "-1", "0.001", "1e-1", "ten", "", True])
def test_a_last_call_that_is_no_usable_number_of_seconds_is_named(value: object) -> None:
    with pytest.raises(EtcdConfigError) as info:
        settings(last_call_timeout=value)
    assert "last_call_timeout=%r must be a number of seconds, at least 0.01" % (value,) in str(info.value)


@pytest.mark.parametrize(("value", "seconds"), [("0.2", 0.2), (" .5 ", 0.5), ("1", 1.0), (3, 3.0), ("0.01", 0.01)])
def test_the_last_call_takes_fractions_of_a_second(value: object, seconds: float) -> None:
    parsed = settings(last_call_timeout=value)
    assert parsed.last_call_timeout == seconds
    assert parsed.rendezvous_timeout().last_call.total_seconds() == seconds


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("true", True), ("FALSE", False), ("0", False), (False, False)])
def test_early_close_is_on_unless_turned_off(value: object, expected: bool) -> None:
    assert settings(**({} if value is None else {"early_close": value})).early_close is expected


def test_early_close_that_is_no_boolean_is_named() -> None:
    with pytest.raises(EtcdConfigError, match="early_close='sometimes' must be true or false"):
        settings(early_close="sometimes")


def test_the_reachability_check_is_on_with_five_seconds_unless_set() -> None:
    parsed = settings()
    assert (parsed.reach_check, parsed.reach_timeout) == (True, 5.0)
    parsed = settings(reach_check="false", reach_timeout="0.5")
    assert (parsed.reach_check, parsed.reach_timeout) == (False, 0.5)


def test_bad_reachability_settings_are_named_together() -> None:
    with pytest.raises(EtcdConfigError, match=r"(?s)reach_check='maybe' must be true or false.*reach_timeout='-1'"):
        settings(reach_check="maybe", reach_timeout="-1")


def test_integer_values_from_the_command_line_are_accepted() -> None:
    parsed = settings(ttl="600", read_timeout=" 20 ", join_timeout="40", keep_alive_interval=2)
    assert (parsed.ttl, parsed.read_timeout) == (600, 20)


def test_read_timeout_defaults_to_half_a_short_join_timeout() -> None:
    assert settings(join_timeout="20").read_timeout == 10
    assert settings(join_timeout="1").read_timeout == 1


def test_read_timeout_longer_than_half_the_join_timeout_is_rejected() -> None:
    with pytest.raises(EtcdConfigError, match="read_timeout=16 exceeds half of join_timeout=30"):
        settings(join_timeout="30", read_timeout="16")
    assert settings(join_timeout="30", read_timeout="15").read_timeout == 15


def test_ttl_must_outlive_the_heartbeat_window() -> None:
    with pytest.raises(EtcdConfigError, match="ttl='20' must exceed keep_alive_interval"):
        settings(ttl="20", keep_alive_interval="10", keep_alive_max_attempt="2")


def test_unknown_key_is_rejected_with_the_known_ones_listed() -> None:
    with pytest.raises(EtcdConfigError, match="unknown --rdzv-conf key.*ca_cert.*known keys: cacert"):
        settings(ca_cert="/x.pem")


def test_tls_files_must_exist_and_cert_needs_key(tmp_path: Path) -> None:
    cert = tmp_path / "client.pem"
    cert.write_text("pem")
    with pytest.raises(EtcdConfigError) as info:
        settings(cacert=str(tmp_path / "missing.pem"), cert=str(cert))
    assert "cacert=" in str(info.value) and "not a readable file" in str(info.value)
    assert "cert and key must be given together" in str(info.value)


def test_tls_files_reach_the_client_options(tmp_path: Path) -> None:
    paths = {name: tmp_path / (name + ".pem") for name in ("cacert", "cert", "key")}
    for path in paths.values():
        path.write_text("pem")
    options = settings(**{name: str(path) for name, path in paths.items()}).client_options()
    assert (options.ca_cert, options.cert, options.key) == tuple(str(p) for p in paths.values())
    assert options.secure


def test_user_needs_password_and_the_password_is_never_echoed() -> None:
    with pytest.raises(EtcdConfigError) as info:
        settings(password="hunter2", ttl="0")
    assert "user and password must be given together" in str(info.value)
    assert "hunter2" not in str(info.value)
    parsed = settings(user="train", password="hunter2")
    assert "hunter2" not in repr(parsed) and "hunter2" not in repr(parsed.client_options())


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(EtcdConfigError) as info:
        settings("h1:99999", "a/b", ttl="x", key_prefix="no-slash", bogus="1")
    message = str(info.value)
    for fragment in ("h1:99999", "--rdzv-id='a/b'", "ttl='x'", "key_prefix='no-slash'", "bogus"):
        assert fragment in message


def test_key_prefix_gets_a_trailing_slash() -> None:
    assert settings(key_prefix="/team/rdzv").run_prefix == "/team/rdzv/job/"


def test_config_error_is_a_value_error_and_a_project_error() -> None:
    with pytest.raises(ValueError):
        settings(ttl="0")
    with pytest.raises(ConfigError):
        settings(ttl="0")


def test_create_store_validates_before_connecting() -> None:
    params = RendezvousParameters("etcd-v3", "127.0.0.1:1", "job", 1, 1, join_timeout="abc")
    with pytest.raises(EtcdConfigError, match="join_timeout='abc'"):
        create_store(params)


def test_endpoint_schemes_are_case_insensitive() -> None:
    assert settings("hTTp://h1:2379").endpoints == ("h1:2379",)
    assert settings("HTTPS://h1:2379").client_options().secure


def test_torchs_protocol_key_is_accepted_and_https_turns_on_tls() -> None:
    assert not settings("h1:2379", protocol="http").client_options().secure
    assert settings("h1:2379", protocol="HTTPS").client_options().secure
    assert settings("https://h1:2379", protocol="https").client_options().secure


@pytest.mark.parametrize(("endpoint", "protocol", "named"), [
    ("h1:2379", "ftp", "protocol='ftp' must be http or https"),
    ("https://h1:2379", "http", "contradicts the scheme"),
])
def test_a_bad_or_contradicting_protocol_is_refused(endpoint: str, protocol: str, named: str) -> None:
    with pytest.raises(EtcdConfigError, match=named):
        settings(endpoint, protocol=protocol)
