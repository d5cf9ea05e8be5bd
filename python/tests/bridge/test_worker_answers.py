"""Every request is answered under its id, whatever the code it ran raised, and even when
the worker's own handling of it fails (docs/PROTOCOL.md, "Every request is answered").

The review's a6.py: an exception whose ``__str__`` raises made the error reply itself
raise, and the executor's last guard only logged: the caller waited out its deadline.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import WorkerCallError, WorkerProc, next_id, spawn_worker

from vllm_bridge.bridge.protocol.errors import BadArgument, error_map
from vllm_bridge.bridge.protocol.framing import FrameReader, write_frame
from vllm_bridge.bridge.protocol.messages import Invoke
from vllm_bridge.bridge.worker.executor import Executor

D = "vllm_bridge.bridge.diag"
A = "answer_support"


@pytest.fixture(scope="module")
def w() -> Iterator[WorkerProc]:
    wp = spawn_worker(["--allow", D, A], support=True)
    try:
        yield wp
    finally:
        wp.stop()


def error_of(attempt: Any) -> dict[str, Any]:
    with pytest.raises(WorkerCallError) as info:
        attempt()
    return info.value.error


@pytest.mark.parametrize(
    "kind,why",
    [("StrFails", "RuntimeError: no str"), ("WorseStrFails", "StrFails"),
     ("BaseStrFails", "RuntimeError: no str either")],
)
def test_an_exception_whose_str_raises_is_answered(w: WorkerProc, kind: str, why: str) -> None:
    w.call(D, "set_var", "kept", session="s")
    err = error_of(lambda: w.call(A, "raise_it", kind, session="s"))
    assert err["type"] == "python_exception"
    assert err["message"].startswith(f"<exception str() failed: {why}")
    assert err["python_type"] == f"{A}.{kind}"
    assert f"{A}.{kind}" in err["traceback"]
    assert w.call(D, "get_var", session="s") == "kept"
    assert w.ping()["running"] is None


def test_a_request_whose_handling_fails_in_the_worker_is_answered(w: WorkerProc) -> None:
    """A fault injected into the worker (its error replies cannot be built): the failing
    request still gets an error under its id, from the executor's last guard, and the
    worker goes on."""
    w.call(A, "break_error_replies")
    try:
        rid = next_id()
        w.send(["call", rid, "s", 30_000, ["m", D, "fail"], ["boom"], {}])
        kind, got, err = w.reply(rid)
        assert (kind, got, err["type"]) == ("error", rid, "python_exception")
        assert err["message"] == (
            f"call {rid} failed inside the worker, outside the code it ran (RuntimeError: "
            "injected: error replies cannot be built); the worker goes on"
        )
        assert w.call(D, "add", 1, 2) == 3
    finally:
        w.call(A, "mend_error_replies")
    assert error_of(lambda: w.call(D, "fail", "boom"))["message"] == "boom"


def test_error_map_never_raises() -> None:
    class Nasty(Exception):
        def __str__(self) -> str:
            raise Nasty()  # its own __str__ raises again, forever

    for exc in (Nasty(), BadArgument("fine")):
        err = error_map(exc)
        assert isinstance(err["message"], str)
    assert error_map(Nasty())["message"].startswith("<exception str() failed: ")


def test_the_executors_last_guard_answers_and_lets_an_interrupt_through() -> None:
    """In process: a handler that raises is answered through ``failed``; a
    ``KeyboardInterrupt`` is answered, then ends the run, as before."""
    read_fd, write_fd = os.pipe()
    sent: list[Any] = []

    def handle(req: Invoke) -> Any:
        raise (KeyboardInterrupt() if req.id == 2 else ValueError(f"handler {req.id}"))

    def on_frame(body: Any) -> Invoke:
        return Invoke("call", int(bytes(body)), None, None)

    executor = Executor(handle, lambda _r, _e: None, sent.append, on_frame,
                        FrameReader(fd=read_fd), failed=lambda req, msg: (req.id, msg))
    ended: list[BaseException] = []

    def run() -> None:
        try:
            executor.run()
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            ended.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    write_frame(b"1", fd=write_fd)
    write_frame(b"2", fd=write_fd)
    thread.join(10)
    os.close(write_fd)
    os.close(read_fd)
    assert not thread.is_alive()
    assert [i for i, _ in sent] == [1, 2]
    assert "(ValueError: handler 1)" in sent[0][1]
    assert "(KeyboardInterrupt: )" in sent[1][1]
    assert [type(e) for e in ended] == [KeyboardInterrupt]
