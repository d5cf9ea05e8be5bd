"""Who may choose where the DP group's rendezvous is: the rule on ``master_addr`` and
``master_port`` in :func:`vllm_bridge.dp.init_dp_group`.

The worker's environment (``VLLM_DP_MASTER_IP`` / ``VLLM_DP_MASTER_PORT``, set by the
operator through the pool's ``dp:`` option) may name any host; an argument of a call may
name only a loopback address written canonically, ``localhost``, or the configured
address itself (and then not another port). Everything else is refused, naming the value,
before any name is resolved or any socket opened: the network functions are replaced by
ones that record being reached.
"""

import ipaddress
import random
import socket

import pytest
import torch.distributed as dist

from dp_env import clean_env, free_port  # noqa: F401 (clean_env: a fixture)
from vllm_bridge import dp


# Spellings of a loopback address that resolvers (inet_aton, getaddrinfo) accept but that
# are not the canonical text of a loopback IP, and loopback with a port, a scope, spaces.
NON_CANONICAL_LOOPBACK = [
    "127.1",
    "127.0.1",
    "0x7f000001",
    "0x7f.0.0.1",
    "2130706433",
    "0177.0.0.1",
    "0177.0000.0000.0001",
    "127.000.000.001",
    "127.0.0.01",
    "127.0.0.1.",
    "127.0.0.256",
    "::ffff:127.0.0.1",
    "::ffff:7f00:1",
    "::127.0.0.1",
    "64:ff9b::7f00:1",
    "0:0:0:0:0:0:0:1",
    "0::1",
    "::0001",
    "::1%lo",
    "::1%1",
    "[::1]",
    "[::1]:29500",
    "127.0.0.1:29500",
    "localhost:29500",
    " 127.0.0.1",
    "127.0.0.1 ",
    "127.0.0.1\n",
    "\t::1",
    "127.0.0.1\x00",
    "127.0.0.1\x00.evil.example",
    "\uff11\uff12\uff17.0.0.1",  # full-width digits
    "LOCALHOST",
    "Localhost",
    "localhost.",
    "localhost.localdomain",
    "ip6-localhost",
    "x.localhost",
    "0.0.0.0",
    "0",
    "::",
    "[::]",
    "*",
]


def _generated_refused(seed: int = 20261125, n: int = 40) -> list[str]:
    """Public and private IPv4 / IPv6 addresses and host names, from a seeded generator."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        v4 = ipaddress.IPv4Address(rng.getrandbits(32))
        if not v4.is_loopback:
            out.append(str(v4))
        v6 = ipaddress.IPv6Address(rng.getrandbits(128))
        if not v6.is_loopback:
            out.append(str(v6))
    for net in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",
                "100.64.0.0/10", "fc00::/7", "fe80::/10"):
        network = ipaddress.ip_network(net)
        out.append(str(network[rng.randrange(1, network.num_addresses - 1)]))
    chars = "abcdefghijklmnopqrstuvwxyz0123456789-"

    def label() -> str:
        return rng.choice("abcdefghij") + "".join(
            rng.choice(chars) for _ in range(rng.randint(0, 12))
        )

    for _ in range(8):
        name = ".".join(label() for _ in range(rng.randint(1, 4)))
        out.append(name + rng.choice(["", ".example", ".internal", ".local"]))
    out += ["169.254.169.254", "metadata.google.internal", "10.1.2.3", "fe80::1%eth0"]
    return out


LONG = ["a" * 100_000, "127.0.0.1" + "0" * 10_000, "1." * 50_000, "::1" + " " * 5_000]
REFUSED = NON_CANONICAL_LOOPBACK + _generated_refused() + [""] + LONG
NOT_STR = [2130706433, 0x7F000001 + 0.0, b"127.0.0.1", bytearray(b"::1"), ["127.0.0.1"],
           ("127.0.0.1", 29500), True, ipaddress.IPv4Address("127.0.0.1"), object()]




@pytest.fixture
def network(clean_env: pytest.MonkeyPatch) -> list[str]:
    """Every way in to the network the rendezvous uses, recorded (and failed) if reached."""
    reached: list[str] = []

    def tripwire(name: str):
        def reach(*args, **kwargs):
            reached.append(f"{name}{args!r}")
            # RuntimeError: what the rendezvous reports of a store that failed to open.
            raise RuntimeError(f"{name} reached: {args!r}")

        return reach

    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "create_connection"):
        clean_env.setattr(socket, name, tripwire(f"socket.{name}"))
    clean_env.setattr(socket.socket, "connect", tripwire("socket.connect"))
    clean_env.setattr(dist, "TCPStore", tripwire("TCPStore"))
    clean_env.setattr(dist, "init_process_group", tripwire("init_process_group"))
    return reached


def _named(value: str, message: str) -> bool:
    return repr(value[:80]) in message or repr(value[:80])[:-1] in message


@pytest.mark.parametrize("addr", REFUSED, ids=lambda a: repr(a[:40]))
def test_a_call_cannot_name_a_remote_or_odd_address(network: list[str], addr: str) -> None:
    with pytest.raises(ValueError) as err:
        dp.init_dp_group(0, 1, addr, 29500, "gloo", 1.0)
    message = str(err.value)
    assert _named(addr, message), message
    assert "dp:" in message and "VLLM_DP_MASTER_IP" in message, message
    assert len(message) < 1000
    assert network == [] and dp.dp_group_info() is None


@pytest.mark.parametrize("addr", REFUSED[:12] + ["10.9.9.9", "10.0.0.1 "], ids=repr)
def test_the_rule_holds_with_a_remote_rendezvous_configured(
    clean_env: pytest.MonkeyPatch, network: list[str], addr: str
) -> None:
    # The operator's address is open to the caller; another one still is not.
    clean_env.setenv("VLLM_DP_MASTER_IP", "10.0.0.1")
    clean_env.setenv("VLLM_DP_MASTER_PORT", "29555")
    with pytest.raises(ValueError) as err:
        dp.init_dp_group(0, 1, addr, 29555, "gloo", 1.0)
    assert _named(addr, str(err.value)) and "dp:" in str(err.value)
    assert network == []


@pytest.mark.parametrize("value", NOT_STR, ids=lambda v: type(v).__name__)
def test_a_master_addr_that_is_not_a_str_is_refused(network: list[str], value: object) -> None:
    with pytest.raises(TypeError, match="master_addr must be a str") as err:
        dp.init_dp_group(0, 1, value, 29500, "gloo", 1.0)
    assert repr(value)[:40] in str(err.value)
    assert network == []


def test_the_configured_host_keeps_its_configured_port(
    clean_env: pytest.MonkeyPatch, network: list[str]
) -> None:
    clean_env.setenv("VLLM_DP_MASTER_IP", "10.0.0.1")
    clean_env.setenv("VLLM_DP_MASTER_PORT", "29555")
    for kwargs in ({"master_addr": "10.0.0.1"}, {}):
        with pytest.raises(ValueError, match="master_port 22 .*'10.0.0.1'.* 29555") as err:
            dp.init_dp_group(0, 1, master_port=22, backend="gloo", timeout_s=1.0, **kwargs)
        assert "dp:" in str(err.value)
    assert network == [] and dp.dp_group_info() is None


def test_the_configured_address_and_port_are_taken(
    clean_env: pytest.MonkeyPatch, network: list[str]
) -> None:
    """The operator's own rendezvous, named in the call or left to the environment, gets
    as far as the store (the tripwire)."""
    clean_env.setenv("VLLM_DP_MASTER_IP", "dp-master.internal")
    clean_env.setenv("VLLM_DP_MASTER_PORT", "29555")
    for args in (("dp-master.internal", 29555), ("dp-master.internal", None), (None, None)):
        with pytest.raises(dp.DPGroupError, match="TCPStore reached"):
            dp.init_dp_group(0, 1, *args, "gloo", 1.0)
    assert network == ["TCPStore('dp-master.internal', 29555, 1, True)"] * 3



@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost"])
def test_loopback_joins_a_real_group_on_any_port(clean_env: pytest.MonkeyPatch, addr: str) -> None:
    # A remote rendezvous configured does not stop a loopback one at another port.
    clean_env.setenv("VLLM_DP_MASTER_IP", "10.0.0.1")
    clean_env.setenv("VLLM_DP_MASTER_PORT", "29555")
    port = free_port()
    info = dp.init_dp_group(0, 1, addr, port, "gloo", 5.0)
    assert (info.master_addr, info.master_port) == (addr, port)
    assert dp.destroy_dp_group() is True


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "localhost"])
def test_canonical_loopback_is_allowed(network: list[str], addr: str) -> None:
    # Accepted: it goes on to the rendezvous, where the tripwire stops it.
    with pytest.raises(dp.DPGroupError, match="TCPStore reached"):
        dp.init_dp_group(0, 1, addr, 29500, "gloo", 1.0)
    assert network == [f"TCPStore({addr!r}, 29500, 1, True)"]
