"""Joining a DP group: rank 0's rendezvous store, the wait for it, ``init_process_group``
and a first all_reduce that every rank must answer, each bounded by the group's timeout
(:func:`rendezvous`).

Part of :mod:`vllm_bridge.dp`, which holds the group's state and the errors, and imports
this module. This module never imports that one (no import circle): the group's
:class:`~vllm_bridge.dp.DPGroupInfo` and the two error classes to raise are passed in.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from vllm_bridge.dp import DPGroupInfo


def _wait_for_master(
    addr: str, port: int, deadline: float, rank: int, timeout_error: type[Exception]
) -> None:
    """Poll until rank 0's store accepts connections, so a missing master fails on time."""
    while True:
        try:
            with socket.create_connection((addr, port), timeout=0.5):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise timeout_error(
                    f"DP rank {rank}: no rank 0 rendezvous at {addr}:{port} "
                    f"within the timeout ({exc})"
                ) from None
            time.sleep(0.05)


def _open_store(
    info: DPGroupInfo,
    timeout: datetime.timedelta,
    deadline: float,
    timeout_error: type[Exception],
    group_error: type[Exception],
) -> dist.Store:
    """Host (rank 0) or connect to the rendezvous store, giving up at ``deadline``.

    A client whose connection is accepted by something that never answers (a frozen rank 0,
    a foreign service on the port) can block in the store constructor past its own timeout,
    so the constructor runs in a helper thread and is abandoned at the deadline.
    """
    where = f"{info.master_addr}:{info.master_port}"
    result: list[Any] = []

    def connect() -> None:
        try:
            result.append(
                dist.TCPStore(
                    info.master_addr,
                    info.master_port,
                    info.world_size,
                    info.rank == 0,
                    timeout=timeout,
                    wait_for_workers=False,
                )
            )
        except (RuntimeError, OSError) as exc:
            result.append(exc)

    thread = threading.Thread(target=connect, name="vllm-bridge-dp-store", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
    if not result:
        raise timeout_error(
            f"DP rank {info.rank}: {where} accepted the connection but did not answer as a "
            f"rendezvous store within {info.timeout_s} s"
        )
    if isinstance(result[0], BaseException):
        raise group_error(
            f"DP rank {info.rank}: cannot open the rendezvous store at {where}: {result[0]}"
        ) from result[0]
    return result[0]


def rendezvous(
    info: DPGroupInfo, timeout_error: type[Exception], group_error: type[Exception]
) -> dist.Store:
    """Meet the other ranks: returns the store the process group was set up on.

    Raises ``timeout_error`` when a peer does not arrive within ``info.timeout_s`` and
    ``group_error`` when the rendezvous store cannot be opened (the callers pass
    :class:`~vllm_bridge.dp.DPTimeoutError` and :class:`~vllm_bridge.dp.DPGroupError`).
    """
    timeout = datetime.timedelta(seconds=info.timeout_s)
    deadline = time.monotonic() + info.timeout_s
    where = f"{info.master_addr}:{info.master_port}"
    if info.rank != 0:
        _wait_for_master(info.master_addr, info.master_port, deadline, info.rank, timeout_error)
    store = _open_store(info, timeout, deadline, timeout_error, group_error)
    # A failed init_process_group leaves torch's group counter advanced, and the counter
    # prefixes the rendezvous keys: put it back so a retry meets its peers' keys.
    world = getattr(dist.distributed_c10d, "_world", None)
    group_count = getattr(world, "group_count", None)
    try:
        dist.init_process_group(
            info.backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout
        )
    except RuntimeError as exc:
        store = None  # close the store now, not when the exception is collected
        if dist.is_initialized():
            dist.destroy_process_group()
        elif group_count is not None:
            world.group_count = group_count
        raise timeout_error(
            f"DP rank {info.rank} of {info.world_size}: not every rank joined at {where} "
            f"within {info.timeout_s} s ({str(exc).splitlines()[0]})"
        ) from exc
    missing = _roll_call(info, timeout)
    if missing is not None:
        store = None
        dist.destroy_process_group()
        raise timeout_error(
            f"DP rank {info.rank} of {info.world_size}: the group at {where} was set up but "
            f"not every rank answered its first collective within {info.timeout_s} s: a "
            f"rank died while joining, or the store was an earlier group's ({missing})"
        )
    return store


def _roll_call(info: DPGroupInfo, timeout: datetime.timedelta) -> str | None:
    """One all_reduce over the new group: ``None`` when every rank took part, else why not.

    ``init_process_group`` alone can succeed against a dead group: a rank restarted
    after its peer's collective failed reaches the peer's old store, still listening
    until that peer leaves its group, and finds the old group's addresses there. Only a
    collective shows that every rank is really there. Returns instead of raising, so the
    torch error (whose traceback holds the group) is gone when this returns.
    """
    device = torch.device(info.device if info.backend == "nccl" else "cpu")
    try:
        dist.all_reduce(torch.zeros(1, device=device), async_op=True).wait(timeout=timeout)
    except (RuntimeError, TimeoutError) as exc:
        return str(exc).splitlines()[0]
    return None
