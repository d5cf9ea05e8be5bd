"""A DP group after a rank died: the survivor's collective fails within the timeout, a
restarted rank cannot join the dead group's leftovers, and after ``destroy_dp_group()``
the survivor hosts the group again on the same ``master_port`` (the error of the failed
collective still kept, as a bridge session keeps recent errors).

Rank 0 runs the whole story in a spawned process (torch.distributed's state is
per-process) and spawns each rank 1 it needs; the outcomes come back over a queue.
"""

import multiprocessing as mp
import socket
from typing import Any

from dp_env import free_port

#: The ranks that must meet wait this long for each other (a spawned rank imports torch
#: first, which takes seconds on a loaded machine).
TIMEOUT_S = 60.0
#: A rank expected not to get in gives up after this.
LATE_TIMEOUT_S = 3.0
GUARD_S = 180.0


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def _rank1(port: int, then: str, out: Any, timeout_s: float = TIMEOUT_S) -> None:
    """Rank 1: join, then die at once (``then == "die"``) or take part in one all_reduce."""
    import os

    import torch

    from vllm_bridge import dp

    try:
        dp.init_dp_group(1, 2, "127.0.0.1", port, "gloo", timeout_s)
    except dp.DPGroupError as exc:
        out.put(("rank1", type(exc).__name__, str(exc)))
        return
    if then == "die":
        os._exit(0)
    out.put(("rank1", "sum", dp.dp_all_reduce(torch.tensor([2]), 2, 1).tolist()))
    dp.destroy_dp_group()


def _rank0(port: int, out: Any) -> None:
    import torch

    from vllm_bridge import dp

    ctx = mp.get_context("spawn")

    def start_rank1(then: str, timeout_s: float = TIMEOUT_S) -> Any:
        p = ctx.Process(target=_rank1, args=(port, then, out, timeout_s))
        p.start()
        return p

    dying = start_rank1("die")
    dp.init_dp_group(0, 2, "127.0.0.1", port, "gloo", TIMEOUT_S)
    dying.join()
    kept = []
    try:
        dp.dp_all_reduce(torch.tensor([1]), 2, 0)
    except dp.DPTimeoutError as exc:
        kept.append(exc)
    out.put(("rank0", "failed", [type(e).__name__ for e in kept]))

    # A restarted rank 1 meets rank 0's old store (still listening: rank 0 has not left
    # its broken group) and must fail its join, not join the dead group.
    late = start_rank1("sum", LATE_TIMEOUT_S)
    late.join(GUARD_S)

    dp.destroy_dp_group()
    out.put(("rank0", "port_free", _port_free(port)))
    again = start_rank1("sum")
    dp.init_dp_group(0, 2, "127.0.0.1", port, "gloo", TIMEOUT_S)
    out.put(("rank0", "sum", dp.dp_all_reduce(torch.tensor([1]), 2, 0).tolist()))
    again.join(GUARD_S)
    dp.destroy_dp_group()
    out.put(("rank0", "kept", len(kept)))


def test_a_dead_rank_fails_the_step_and_the_group_is_joined_again() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    rank0 = ctx.Process(target=_rank0, args=(port, out))
    rank0.start()
    events = []
    while len(events) < 6:
        events.append(out.get(timeout=GUARD_S))
    rank0.join(GUARD_S)
    assert rank0.exitcode == 0

    assert events[0] == ("rank0", "failed", ["DPTimeoutError"])
    who, kind, message = events[1]
    assert (who, kind) == ("rank1", "DPTimeoutError")
    # Refused at init_process_group (the old group's peer does not answer) or at the
    # first collective (it connected to leftovers): either way within the timeout.
    assert message.startswith("DP rank 1 of 2: ")
    assert "not every rank joined" in message or "not every rank answered" in message
    assert events[2] == ("rank0", "port_free", True)
    assert sorted(events[3:5]) == [("rank0", "sum", [3]), ("rank1", "sum", [3])]
    assert events[5] == ("rank0", "kept", 1)


def _rank0_leftovers(port: int, out: Any) -> None:
    """Rank 0 leaves its group while something still holds the old process group (as a
    kept traceback once did): its store and its gloo listener outlive the group.

    Here gloo's mesh to the old group times out; once, through the bridge, it connected
    and only the join's first all_reduce (``_roll_call``) caught it. Either way the late
    rank's join must fail within the timeout."""
    import torch.distributed as dist

    from vllm_bridge import dp

    ctx = mp.get_context("spawn")
    first = ctx.Process(target=_rank1, args=(port, "die", out))
    first.start()
    dp.init_dp_group(0, 2, "127.0.0.1", port, "gloo", TIMEOUT_S)
    first.join(GUARD_S)
    held = dist.distributed_c10d._get_default_group()
    dp.destroy_dp_group()
    # A new rank 1 meets the leftovers: it must not report a group it cannot use.
    late = ctx.Process(target=_rank1, args=(port, "sum", out, LATE_TIMEOUT_S))
    late.start()
    late.join(GUARD_S)
    out.put(("rank0", "held", held is not None))


def test_a_rank_cannot_join_a_group_whose_peer_has_left() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rank0 = ctx.Process(target=_rank0_leftovers, args=(free_port(), out))
    rank0.start()
    events = [out.get(timeout=GUARD_S) for _ in range(2)]
    rank0.join(GUARD_S)
    assert rank0.exitcode == 0
    who, kind, message = events[0]
    assert (who, kind) == ("rank1", "DPTimeoutError"), events
    assert message.startswith("DP rank 1 of 2: ")
    assert "not every rank joined" in message or "not every rank answered" in message
    assert events[1] == ("rank0", "held", True)
