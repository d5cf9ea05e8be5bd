"""How the DP ranks end a micro-batched run together, and rebuild the group after a failure.

Part of :mod:`vllm_bridge.dp` (which holds the group's state and calls these with it).

**Why a side channel.** When one rank's micro-batch thread fails, the other ranks may be
blocked in a collective that the failed rank will never issue. Waiting for the group's
timeout would end the step (eventually) with a timeout, not with the error, and gloo has
no way to cancel a posted collective. So the failed rank writes its error into the
group's rendezvous store (``abort`` key of the run), and a rank waiting on a collective
polls that key (every ``PEER_POLL_S``, only while the collective is still pending) and
gives up at once with the same message. A poison value carried through the remaining
collectives would not do: the failed rank does not know which collectives remain (its
other thread, and the peers', may be anywhere in the model).

**Why one status exchange per run.** A rank can fail after the peers' last collective
has completed, so a peer can finish the run without ever seeing the abort key. Every rank
therefore writes its outcome (``done/<rank>``: ``ok`` or the error) when its threads have
ended, and reads everyone's before returning: a run fails on all ranks or on none. It is
one store write and one wait per micro-batched step.

**Why the group is rebuilt.** After an abort, collectives are posted on some ranks and
not on others; their tags no longer match across ranks, so the group cannot be used
again. Every rank (each learns of the failure through the status exchange) rebuilds it
(:func:`rejoin`): the old process group is unregistered but kept alive (destroying it
would join gloo's worker threads, which stay blocked in the orphaned collective until its
timeout), and a new one is formed on the same store under a fresh key prefix.
"""

from __future__ import annotations

import datetime
import threading
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from vllm_bridge.dp import DPGroupInfo

OK = "ok"

# Old process groups with orphaned collectives: kept referenced so that dropping them
# does not block (see the module docstring). One per failed run; a few threads each.
_graveyard: list[Any] = []


def _key(generation: int, run: int, name: str) -> str:
    return f"vllm_bridge/ubatch/{generation}/{run}/{name}"


def announce_failure(store: dist.Store, generation: int, run: int, message: str) -> None:
    """Tell the other ranks that this rank's run ``run`` failed with ``message``."""
    store.set(_key(generation, run, "abort"), message)


def peer_failure(store: dist.Store, generation: int, run: int) -> str | None:
    """The failure message another rank announced for run ``run``, or ``None``."""
    key = _key(generation, run, "abort")
    if not store.check([key]):
        return None
    return store.get(key).decode("utf-8", "replace")


def finish(
    store: dist.Store, info: DPGroupInfo, generation: int, run: int, error: str | None
) -> str | None:
    """Write this rank's outcome of run ``run`` and wait (at most the group's timeout)
    for every rank's; returns the first failure (lowest rank), or ``None`` when every
    rank succeeded. A rank that never reports is a failure too."""
    store.set(_key(generation, run, f"done/{info.rank}"), OK if error is None else error)
    keys = [_key(generation, run, f"done/{r}") for r in range(info.world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=info.timeout_s))
    except RuntimeError as exc:
        return (
            f"DP rank {info.rank}: not every rank reported the end of the micro-batched run "
            f"within {info.timeout_s} s ({str(exc).splitlines()[0]})"
        )
    if run > 0:
        # Every rank has written run's outcome, so each finished reading run - 1's.
        for r in range(info.world_size):
            store.delete_key(_key(generation, run - 1, f"done/{r}"))
    for r, key in enumerate(keys):
        value = store.get(key).decode("utf-8", "replace")
        if value != OK:
            return value if r == info.rank else f"DP rank {r}: {value}"
    return None


def rejoin(info: DPGroupInfo, store: dist.Store, generation: int) -> None:
    """Replace the default process group by a fresh one on ``store`` (every rank calls
    this after the same failed run; ``generation`` prefixes the new group's keys).

    Raises:
        RuntimeError: the ranks did not all rejoin within the group's timeout.
    """
    if dist.is_initialized():
        _graveyard.append(dist.distributed_c10d._get_default_group())
        dist.destroy_process_group()
    dist.init_process_group(
        info.backend,
        store=dist.PrefixStore(f"vllm_bridge/rejoin/{generation}", store),
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=info.timeout_s),
    )


class UBatchRunSync:
    """One micro-batched run's link to the other DP ranks (``dp.begin_ubatch_run``).

    Args:
        state: The DP group's state (``info``, ``store``, ``broken``, ``generation``).
        lock: The DP module's lock (held while the group is rebuilt).
        timeout_error: The error to raise when the group cannot be rebuilt.
        generation, run: This run's numbers (the same on every rank).
    """

    def __init__(
        self,
        state: Any,
        lock: threading.Lock,
        timeout_error: type[Exception],
        generation: int,
        run: int,
    ) -> None:
        self._state = state
        self._lock = lock
        self._timeout_error = timeout_error
        self.generation = generation
        self.run = run

    def announce_failure(self, message: str) -> None:
        """Tell the other ranks this rank's run failed (best effort, never raises)."""
        try:
            announce_failure(self._state.store, self.generation, self.run, message)
        except RuntimeError:
            pass  # the peers then stop at their own timeout instead

    def peer_failure(self) -> str | None:
        """Another rank's announced failure of this run, or ``None``."""
        return peer_failure(self._state.store, self.generation, self.run)

    def finish(self, error: str | None) -> str | None:
        """Exchange the run's outcome (``error``: this rank's, or ``None``) with every
        rank; after a failure anywhere, rebuild the group on every rank. Returns the first
        failure, or ``None`` when all succeeded.

        Raises:
            timeout_error: the group could not be rebuilt (then it stays broken).
        """
        state = self._state
        with self._lock:
            failure = finish(state.store, state.info, self.generation, self.run, error)
            if failure is None:
                return None
            state.generation += 1
            try:
                rejoin(state.info, state.store, state.generation)
            except RuntimeError as exc:
                state.broken = f"rebuilding the group failed: {str(exc).splitlines()[0]}"
                raise self._timeout_error(
                    f"DP rank {state.info.rank}: after a failed micro-batched run the group "
                    f"could not be rebuilt ({state.broken}); first failure: {failure}"
                ) from exc
            state.broken = None
            return failure
