"""How the DP ranks end a micro-batched run together, and leave the group clean after a
failure. Part of :mod:`vllm_bridge.dp` (which creates :class:`UBatchRunSync` with its state).

**Why a side channel.** When one rank's micro-batch thread fails, the other ranks may be
blocked in a collective that the failed rank will never issue. Waiting for the group's
timeout would end the step (eventually) with a timeout, not with the error. So the failed
rank writes its error into the group's rendezvous store (the run's ``abort`` key), and a
rank waiting on a collective polls that key (every ``PEER_POLL_S``, and only while the
collective is still pending) and gives up at once with the same message. A poison value
carried through the remaining collectives would not do: the failed rank does not know
which collectives remain (its other thread, and the peers', may be anywhere in the model).

**Why one status exchange per run.** A rank can fail after the peers' last collective
has completed, so a peer can finish the run without ever seeing the abort key. Every rank
therefore writes its outcome (``done/<rank>``: ``ok`` or the error) once its threads have
ended, and reads everyone's before returning: a run fails on all ranks or on none. It
costs one store write and one store wait per micro-batched step.

**Why the group is drained, not rebuilt.** After an abort, a collective may be posted on
one rank and not on another; gloo matches collectives by their order, so the next step's
would pair with the wrong ones. The ranks' posted collectives are all prefixes of one
sequence (each rank issues them in the same deterministic turn order and stops at the
failure), so each rank publishes what it posted (kind, shape, dtype) and posts, with zero
tensors, the ones another rank posted beyond its own; then every posted collective has
its partner, all complete, and the group is as after a normal step. Rebuilding the group
instead was tried and dropped: the old group cannot be destroyed while it holds a
collective that never completes (its worker threads are joined, blocking until the
group's timeout), and keeping it alive made a process abort (an uncaught gloo
``Connection closed by peer``) when the peer later exited. If the drain itself fails
(a peer is gone), the group is marked broken, as after any failed collective.
"""

from __future__ import annotations

import datetime
import json
import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from vllm_bridge.dp import DPGroupInfo

OK = "ok"

#: One posted collective: ``(kind, shape, dtype, device type)``, e.g.
#: ``("all_gather", [4, 64], "torch.float32", "cpu")``. The device *type* only: with NCCL
#: each rank uses its own GPU (``cuda:0`` on one, ``cuda:1`` on the other), and the
#: ranks' lists are compared with each other.
PostedOp = tuple[str, list[int], str, str]


def _key(run: int, name: str) -> str:
    return f"vllm_bridge/ubatch/{run}/{name}"


def describe(kind: str, tensor: torch.Tensor) -> PostedOp:
    """What :func:`drain` needs to post a partner of this collective."""
    return (kind, list(tensor.shape), str(tensor.dtype), tensor.device.type)


def partner_device(device_type: str, info: DPGroupInfo) -> torch.device:
    """Where this rank posts the partner of a collective another rank posted on a device of
    ``device_type``: this rank's own device (a CUDA collective on the group's GPU)."""
    if device_type == "cuda":
        if info.device.startswith("cuda"):
            return torch.device(info.device)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _post_partner(op: PostedOp, info: DPGroupInfo) -> Any:
    kind, shape, dtype, device_type = op
    tensor = torch.zeros(
        shape,
        dtype=getattr(torch, dtype.removeprefix("torch.")),
        device=partner_device(device_type, info),
    )
    if kind == "all_reduce":
        return dist.all_reduce(tensor, async_op=True)
    if kind == "all_gather":
        parts = [torch.empty_like(tensor) for _ in range(info.world_size)]
        return dist.all_gather(parts, tensor, async_op=True)
    raise ValueError(f"no partner for a collective of kind {kind!r}")


def check_one_sequence(run: int, everyone: list[list[Any]]) -> list[list[Any]]:
    """The longest of the ranks' posted lists (``everyone[r]``: rank ``r``'s); each rank's
    must be a prefix of it, device types included, device indices not (each rank's own).

    Raises:
        RuntimeError: a rank's list is not a prefix of the longest one.
    """
    def same(op: list[Any]) -> list[Any]:
        kind, shape, dtype, device = op
        return [kind, list(shape), dtype, str(device).split(":")[0]]

    norm = [[same(op) for op in ops] for ops in everyone]
    longest = max(norm, key=len)
    for r, ops in enumerate(norm):
        if ops != longest[: len(ops)]:
            raise RuntimeError(
                f"DP rank {r}'s collectives of micro-batched run {run} are not a prefix of "
                "the longest rank's: the ranks issued them in different orders"
            )
    return longest


def _exchange(store: dist.Store, info: DPGroupInfo, run: int, name: str, value: str) -> list[str]:
    """Write this rank's ``value`` under ``name`` and read every rank's (bounded)."""
    store.set(_key(run, f"{name}/{info.rank}"), value)
    keys = [_key(run, f"{name}/{r}") for r in range(info.world_size)]
    store.wait(keys, datetime.timedelta(seconds=info.timeout_s))
    return [store.get(k).decode("utf-8", "replace") for k in keys]


def drain(
    store: dist.Store, info: DPGroupInfo, run: int, posted: list[PostedOp], works: list[Any]
) -> None:
    """Give every collective posted in run ``run`` on any rank its partner here, then wait
    for all of this rank's (see the module docstring).

    Raises:
        RuntimeError: the ranks' posted collectives are not one sequence, or they did not
            all complete within the group's timeout.
    """
    everyone = [
        json.loads(v) for v in _exchange(store, info, run, "posted", json.dumps(posted))
    ]
    longest = check_one_sequence(run, everyone)
    extra = [_post_partner(tuple(op), info) for op in longest[len(posted):]]
    timeout = datetime.timedelta(seconds=info.timeout_s)
    for work in [*works, *extra]:
        work.wait(timeout=timeout)


class UBatchRunSync:
    """One micro-batched run's link to the other DP ranks (``dp.begin_ubatch_run``).

    Args:
        state: The DP group's state (``info``, ``store``, ``broken``).
        lock: The DP module's lock (held while the group is drained).
        run: This run's number (the same on every rank).
    """

    def __init__(self, state: Any, lock: threading.Lock, run: int) -> None:
        self._state = state
        self._lock = lock
        self.run = run

    def _forget_previous_run(self) -> None:
        """Delete this rank's keys of the previous run (and its abort key, if it failed).

        Every rank has written this run's outcome, so each has read all of the previous
        run's keys. Each rank deletes only its own: one store round trip per successful
        step, three after a failed one.
        """
        if self.run == 0:
            return
        state = self._state
        store, rank, prev = state.store, state.info.rank, self.run - 1
        store.delete_key(_key(prev, f"done/{rank}"))
        if state.ubatch_last_failed:
            store.delete_key(_key(prev, f"posted/{rank}"))
            store.delete_key(_key(prev, "abort"))

    def announce_failure(self, message: str) -> None:
        """Tell the other ranks this rank's run failed (best effort, never raises)."""
        try:
            self._state.store.set(_key(self.run, "abort"), message)
        except RuntimeError:
            pass  # the peers then stop at their own timeout instead

    def peer_failure(self) -> str | None:
        """Another rank's announced failure of this run, or ``None``."""
        key = _key(self.run, "abort")
        store = self._state.store
        if not store.check([key]):
            return None
        return store.get(key).decode("utf-8", "replace")

    def finish(self, error: str | None, posted: list[PostedOp], works: list[Any]) -> str | None:
        """Exchange the run's outcome (``error``: this rank's, or ``None``) with every
        rank; after a failure anywhere, drain the group (:func:`drain`; ``posted`` and
        ``works``: this rank's collectives of the run). Returns the first failure (lowest
        rank), or ``None`` when every rank succeeded.

        Raises:
            RuntimeError: the outcome exchange or the drain failed; the group is then
                marked broken (it must be left and joined again). So is it when anything
                else (an interrupt) stops this half-way: the ranks may then disagree.
        """
        state = self._state
        info = state.info
        with self._lock:
            try:
                outcomes = _exchange(state.store, info, self.run, "done", error or OK)
                self._forget_previous_run()
                failures = [(r, v) for r, v in enumerate(outcomes) if v != OK]
                state.ubatch_last_failed = bool(failures)
                if not failures:
                    return None
                drain(state.store, info, self.run, posted, works)
            except BaseException as exc:
                state.broken = (
                    f"micro-batched run {self.run} could not be ended cleanly: "
                    f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
                )
                raise
            r, message = failures[0]
            return message if r == info.rank else f"DP rank {r}: {message}"
