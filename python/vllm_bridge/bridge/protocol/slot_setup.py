"""Opening the slot directory a worker was given (:mod:`~vllm_bridge.bridge.protocol.slots`):
the checks that make it this process's own (a directory of its uid, mode 0700, not a
link) and its settings from the environment: a bad age said in the log and replaced by
its default, a bad threshold replaced by its default (and one below 1 raised to 1),
rather than costing the worker its start."""

from __future__ import annotations

import logging
import os

from vllm_bridge.bridge.protocol.slots import (
    DEFAULT_MIN_BYTES,
    IDLE_AFTER_S,
    MAX_AGE_S,
    RECLAIM_AFTER_S,
    SlotDir,
)

# (The slot directory's logger: one name for all of its messages.)
_log = logging.getLogger("vllm_bridge.bridge.protocol.slots")


def open_slot_dir(
    path: str | None,
    min_bytes: int = DEFAULT_MIN_BYTES,
    reclaim_after_s: float = RECLAIM_AFTER_S,
    idle_after_s: float = IDLE_AFTER_S,
) -> SlotDir | None:
    """The slot directory at ``path``, or None (no path; not a directory of this uid with
    mode 0700; cannot be opened): then every tensor takes the pipe."""
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        return None
    return SlotDir(
        path=path,
        fd=fd,
        min_bytes=min_bytes,
        reclaim_after_s=reclaim_after_s,
        idle_after_s=idle_after_s,
    )


def slot_dir_from_env() -> SlotDir | None:
    """:func:`open_slot_dir` of ``VLLM_BRIDGE_SHM_DIR`` (threshold
    ``VLLM_BRIDGE_SHM_MIN_BYTES``; ages ``VLLM_BRIDGE_SHM_RECLAIM_S`` and
    ``VLLM_BRIDGE_SHM_IDLE_S``, seconds, for tests), or None."""
    try:
        min_bytes = int(os.environ.get("VLLM_BRIDGE_SHM_MIN_BYTES", DEFAULT_MIN_BYTES))
    except ValueError:
        min_bytes = DEFAULT_MIN_BYTES
    return open_slot_dir(
        os.environ.get("VLLM_BRIDGE_SHM_DIR"),
        max(1, min_bytes),
        reclaim_after_s=_age_from_env("VLLM_BRIDGE_SHM_RECLAIM_S", RECLAIM_AFTER_S),
        idle_after_s=_age_from_env("VLLM_BRIDGE_SHM_IDLE_S", IDLE_AFTER_S),
    )


def _age_from_env(name: str, default: float) -> float:
    """Seconds from the variable ``name``, a number above 0 and at most :data:`MAX_AGE_S`;
    ``default`` when it is not set, or (said in the log, naming the value) when it is not
    such a number: a bad age must not cost the worker its start, nor its sweep."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0 < value <= MAX_AGE_S):
        _log.warning(
            "%s=%r is not a number of seconds above 0 and at most %g: %s s used",
            name, raw, MAX_AGE_S, default,
        )
        return default
    return value
