"""The checks around each collective of the joined DP group: part of :mod:`vllm_bridge.dp`,
which owns the process's group state (``_State``) and its lock and passes its exception
classes in (as to :func:`vllm_bridge.dp._rendezvous.rendezvous`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_bridge._ubatch_current import UBatchAbortedError
from vllm_bridge.dp._ubatch_sync import UBatchRunSync

if TYPE_CHECKING:
    from vllm_bridge.dp import _State as State


def usable_state(
    state: State | None, expected_size: int, expected_rank: int, group_error: type[Exception]
) -> State:
    """``state``, checked against the caller's config; raises ``group_error`` when there is
    none, it does not match, or it broke earlier. Called under the DP lock."""
    if state is None:
        raise group_error(
            f"data_parallel_size is {expected_size} but this process has not joined a "
            "DP group; call vllm_bridge.dp.init_dp_group(...) on every rank first"
        )
    info = state.info
    if (info.world_size, info.rank) != (expected_size, expected_rank):
        raise group_error(
            f"parallel_config says DP rank {expected_rank} of {expected_size} but this "
            f"process joined as rank {info.rank} of {info.world_size}"
        )
    if state.broken is not None:
        raise group_error(
            f"the DP group is unusable after an earlier failure ({state.broken}); "
            "call destroy_dp_group() and init_dp_group() again"
        )
    return state


def wait_collective(
    state: State, what: str, wait: Callable[[], None], timeout_error: type[Exception]
) -> None:
    """Run ``wait()``; a collective that failed or timed out marks the group broken and
    raises ``timeout_error``. A micro-batch abort passes through: the micro-batch wrapper
    recovers the group from it.

    The error is raised without the torch exception chained to it, its text in the
    message instead: that exception's traceback holds the collective's work, the work its
    process group, and the group rank 0's rendezvous store, which would go on listening on
    ``master_port`` for as long as anyone keeps the error (a worker's session keeps recent
    ones), so this process could not host the group again after ``destroy_dp_group()``.
    """
    info = state.info
    failure = _failure_of(wait)
    if failure is None:
        return
    state.broken = failure
    raise timeout_error(
        f"DP rank {info.rank} of {info.world_size}: the {what} did not complete "
        f"within {info.timeout_s} s; a peer is missing or stuck ({state.broken})"
    )


def _failure_of(wait: Callable[[], None]) -> str | None:
    """The first line of the error ``wait()`` raised (``None``: it completed). Returns
    rather than raises, so that error and its traceback are gone when this returns."""
    try:
        wait()
    except UBatchAbortedError:
        raise
    except (RuntimeError, TimeoutError) as exc:
        return str(exc).splitlines()[0]
    return None


def begin_run(state: State | None, lock: threading.Lock) -> UBatchRunSync | None:
    """Number a micro-batched run and return its link to the other ranks (``None``: no
    group). Called under ``lock``."""
    if state is None:
        return None
    sync = UBatchRunSync(state, lock, state.ubatch_runs)
    state.ubatch_runs += 1
    return sync
