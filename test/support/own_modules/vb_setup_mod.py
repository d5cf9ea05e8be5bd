"""Per-worker setup for the on_start and call_all tests: what a model loader does.

``setup`` records, in this process, that it ran (how often, with what); ``use`` is a call
that needs it ("call setup() first" otherwise), as the issue's model did.
"""

import os
import time
from pathlib import Path

__all__ = ["setup", "use", "fail", "gated_setup", "rank", "fail_on_rank"]

_state: dict = {}


def setup(tag: str, *, times: int = 1) -> dict:
    """Loads "the model": remembers the tag, the pid and how many setups ran here."""
    _state["tag"] = tag * times
    _state["pid"] = os.getpid()
    _state["setups"] = _state.get("setups", 0) + 1
    return dict(_state)


def use() -> dict:
    """What a forward needs: the setup of this very process."""
    if "tag" not in _state:
        raise RuntimeError("call setup() first")
    _state["calls"] = _state.get("calls", 0) + 1
    return dict(_state)


def fail(message: str) -> None:
    """An on_start that cannot load."""
    raise ValueError(message)


def gated_setup(started: str, gate: str, tag: str) -> dict:
    """Writes ``started`` (the worker has done its handshake and runs its setup), then waits
    until the file ``gate`` exists, then sets up."""
    # Written whole under another name, then renamed: the test reads the pid as soon as
    # the file exists, and a plain write let it read an empty file under load.
    Path(started + ".tmp").write_text(str(os.getpid()))
    os.rename(started + ".tmp", started)
    while not os.path.exists(gate):
        time.sleep(0.01)
    return setup(tag)


def rank() -> str | None:
    """The worker's VB_RANK (from worker_env)."""
    return os.environ.get("VB_RANK")


def fail_on_rank(bad: str) -> str:
    """Fails on the worker whose VB_RANK is ``bad``; the rank elsewhere."""
    if os.environ.get("VB_RANK") == bad:
        raise ValueError(f"rank {bad} refuses")
    return os.environ["VB_RANK"]
