"""Settings of the DP group: arguments, with the environment as fallback, checked.

See :mod:`vllm_bridge.dp` for the variables and what they mean. The environment is the
operator's (the pool option ``dp:`` sets it) and may name any rendezvous; an argument is
the caller's and may name only a loopback one or the configured one
(:func:`check_caller_addr`, :func:`check_caller_port`).
"""

import ipaddress
import os

import torch

from vllm_bridge._checks import check_int

#: Seconds to wait for peers when neither the argument nor ``VLLM_DP_TIMEOUT_S`` says.
DEFAULT_TIMEOUT_S: float = 60.0
BACKENDS = ("gloo", "nccl", "cpu:gloo,cuda:nccl")
WILDCARDS = ("0.0.0.0", "::", "[::]", "*")
DEFAULT_MASTER_ADDR = "127.0.0.1"
#: Characters of a refused address a message shows.
_SHOWN = 80
_REMOTE = (
    "a remote rendezvous is set by the pool's dp: option (VLLM_DP_MASTER_IP, "
    "VLLM_DP_MASTER_PORT in the worker's environment), not by a call"
)


def _shown(addr: str) -> str:
    if len(addr) <= _SHOWN:
        return repr(addr)
    return f"{addr[:_SHOWN]!r}... ({len(addr)} characters)"


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` is ``localhost``, ``::1`` or an address of 127.0.0.0/8 written as
    :class:`ipaddress.IPv4Address` writes it.

    Only the one canonical text of each address: the other spellings a resolver takes
    (``127.1``, ``0x7f000001``, ``2130706433``, ``0177.0.0.1``, ``0:0::1``, an IPv4-mapped
    ``::ffff:127.0.0.1``, a scope ``::1%lo``, a port, spaces) are not loopback here. No
    name is resolved.
    """
    if addr in ("localhost", "::1"):
        return True
    try:
        ip = ipaddress.IPv4Address(addr)
    except ValueError:
        return False
    return ip.is_loopback and str(ip) == addr


def configured_addr() -> str:
    """The operator's rendezvous address: ``VLLM_DP_MASTER_IP``, else ``127.0.0.1``."""
    return os.environ.get("VLLM_DP_MASTER_IP") or DEFAULT_MASTER_ADDR


def check_caller_addr(master_addr: object) -> str:
    """``master_addr`` given in a call, as a plain ``str``, if a call may name it.

    A call may name a loopback address (:func:`is_loopback`) or exactly the configured
    ``VLLM_DP_MASTER_IP``; any other host is the operator's to choose, so a caller of the
    worker cannot make it connect to (or resolve) a host of the caller's choosing. Checked
    before anything is resolved or connected.

    Raises:
        TypeError: not a ``str``.
        ValueError: any other address, named (cut to 80 characters).
    """
    if not isinstance(master_addr, str):
        raise TypeError(f"master_addr must be a str, got {master_addr!r:.{_SHOWN}}")
    addr = str.__str__(master_addr)  # a plain str: a subclass's methods play no part
    if is_loopback(addr) or addr == configured_addr():
        return addr
    raise ValueError(
        f"master_addr {_shown(addr)} is refused: a call may name only a loopback address "
        "(localhost, ::1, or 127.x.y.z written canonically, such as 127.0.0.1) or the "
        f"worker's configured VLLM_DP_MASTER_IP; {_REMOTE}"
    )


def check_caller_port(master_addr: str, master_port: int) -> None:
    """Refuse a ``master_port`` given in a call that points the configured remote
    rendezvous host (``VLLM_DP_MASTER_IP``, not loopback) at another port than the
    configured ``VLLM_DP_MASTER_PORT``. Loopback takes any port.

    Raises:
        ValueError: naming the port, the host and the configured port.
    """
    if is_loopback(master_addr) or master_addr != os.environ.get("VLLM_DP_MASTER_IP"):
        return
    configured = _env_int("VLLM_DP_MASTER_PORT")
    if configured is not None and master_port != configured:
        raise ValueError(
            f"master_port {master_port!r} is refused for master_addr {master_addr!r}: the "
            f"worker's configured rendezvous there is port {configured} "
            f"(VLLM_DP_MASTER_PORT), and a call may not point that host at another port; "
            f"{_REMOTE}"
        )


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _resolve_timeout(timeout_s: float | None) -> float:
    if timeout_s is None:
        raw = os.environ.get("VLLM_DP_TIMEOUT_S")
        if raw is None or raw == "":
            return DEFAULT_TIMEOUT_S
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"VLLM_DP_TIMEOUT_S must be a number, got {raw!r}") from None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    return float(timeout_s)


def _resolve_backend(backend: str | None) -> str:
    if backend is None:
        backend = os.environ.get("VLLM_DP_BACKEND") or (
            "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if "nccl" in backend and not torch.cuda.is_available():
        raise ValueError(f"backend {backend!r} needs CUDA, which this process does not have")
    return backend


def resolve_settings(
    rank: int | None,
    world_size: int | None,
    master_addr: str | None,
    master_port: int | None,
    backend: str | None,
    timeout_s: float | None,
) -> tuple[int, int, str, int, str, float]:
    """``(rank, world_size, master_addr, master_port, backend, timeout_s)``, resolved.

    ``None`` arguments come from ``VLLM_DP_RANK``, ``VLLM_DP_SIZE``, ``VLLM_DP_MASTER_IP``
    (default ``127.0.0.1``), ``VLLM_DP_MASTER_PORT``, ``VLLM_DP_BACKEND`` and
    ``VLLM_DP_TIMEOUT_S``. A ``master_addr`` or ``master_port`` given as an argument
    must pass :func:`check_caller_addr` / :func:`check_caller_port`.

    Raises:
        ValueError / TypeError: a missing or bad setting, named in the message.
    """
    port_given = master_port is not None
    # The caller's address first: nothing below resolves or connects, but keep it so.
    master_addr = configured_addr() if master_addr is None else check_caller_addr(master_addr)
    rank = rank if rank is not None else _env_int("VLLM_DP_RANK")
    world_size = world_size if world_size is not None else _env_int("VLLM_DP_SIZE")
    master_port = master_port if master_port is not None else _env_int("VLLM_DP_MASTER_PORT")
    if rank is None:
        raise ValueError("rank is required (argument or VLLM_DP_RANK)")
    if world_size is None:
        raise ValueError("world_size is required (argument or VLLM_DP_SIZE)")
    if master_port is None:
        raise ValueError("master_port is required (argument or VLLM_DP_MASTER_PORT)")
    check_int("world_size", world_size, minimum=1)
    check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size ({world_size}), got {rank}")
    check_int("master_port", master_port, minimum=1)
    if master_port > 65535:
        raise ValueError(f"master_port must be <= 65535, got {master_port}")
    if port_given:
        check_caller_port(master_addr, master_port)
    if master_addr.strip() != master_addr or master_addr in WILDCARDS:
        # The address the other ranks connect to (rank 0's store listens on every
        # interface anyway): a wildcard reaches rank 0 from no other host.
        raise ValueError(
            "master_addr must be the address of rank 0's host as the other ranks reach it, "
            f"got {master_addr!r}"
        )
    return (
        rank,
        world_size,
        master_addr,
        master_port,
        _resolve_backend(backend),
        _resolve_timeout(timeout_s),
    )
