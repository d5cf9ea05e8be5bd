"""Settings of the DP group: arguments, with the environment as fallback, checked.

See :mod:`vllm_bridge.dp` for the variables and what they mean.
"""

import os

import torch

from vllm_bridge._checks import check_int

#: Seconds to wait for peers when neither the argument nor ``VLLM_DP_TIMEOUT_S`` says.
DEFAULT_TIMEOUT_S: float = 60.0
BACKENDS = ("gloo", "nccl", "cpu:gloo,cuda:nccl")
WILDCARDS = ("0.0.0.0", "::", "[::]", "*")


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
    ``VLLM_DP_TIMEOUT_S``.

    Raises:
        ValueError / TypeError: a missing or bad setting, named in the message.
    """
    rank = rank if rank is not None else _env_int("VLLM_DP_RANK")
    world_size = world_size if world_size is not None else _env_int("VLLM_DP_SIZE")
    master_addr = master_addr or os.environ.get("VLLM_DP_MASTER_IP") or "127.0.0.1"
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
    if not isinstance(master_addr, str):
        raise TypeError(f"master_addr must be a str, got {master_addr!r}")
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
