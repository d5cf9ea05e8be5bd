"""Sessions against a real worker: contextvars isolation, references, context managers."""

from __future__ import annotations

import pytest
from conftest import WorkerCallError, next_id, spawn_worker

from vllm_bridge.bridge.diag import Sample
from vllm_bridge.bridge.protocol import Ref

D = "vllm_bridge.bridge.diag"


def error_of(fn, *args, **kwargs) -> dict:
    with pytest.raises(WorkerCallError) as info:
        fn(*args, **kwargs)
    return info.value.error


def close(w, session) -> dict:
    rid = next_id()
    kind, got, counts = w.request(["close", rid, session])
    assert (kind, got) == ("ok", rid)
    return counts


def exit_ctx(w, session, handle, exc=None):
    rid = next_id()
    reply = w.request(["exit", rid, session, 5000, handle, exc])
    assert reply[1] == rid
    return reply


# -- contextvars -----------------------------------------------------------------------------


def test_each_session_has_its_own_context(shared_worker):
    w = shared_worker
    assert w.call(D, "set_var", "one", session="iso-1") is None
    assert w.call(D, "set_var", "two", session="iso-2") is None
    assert w.call(D, "get_var", session="iso-1") == "one"
    assert w.call(D, "get_var", session="iso-2") == "two"
    assert w.call(D, "get_var") is None  # the default session
    close(w, "iso-1")
    assert w.call(D, "get_var", session="iso-1") is None  # a closed session starts afresh
    assert w.call(D, "get_var", session="iso-2") == "two"
    # An entered context (the recorder sets the variable, as the forward context does)
    # is seen by later calls of its own session only, until it is exited.
    handle, _ = w.call(D, "recorder", "inside", session="iso-2", via="enter")
    assert w.call(D, "get_var", session="iso-2") == "inside"
    assert w.call(D, "get_var", session="iso-1") is None
    assert exit_ctx(w, "iso-2", handle)[0] == "ok"
    assert w.call(D, "get_var", session="iso-2") == "two"
    close(w, "iso-2")


# -- references ------------------------------------------------------------------------------


def test_references_are_used_released_and_refused(shared_worker):
    w = shared_worker
    ref = w.call(D, "opaque", 10, session="refs-a")
    assert isinstance(ref, Ref)
    assert (ref.instance, ref.session, ref.type_name) == (
        w.hello["instance"],
        "refs-a",
        "vllm_bridge.bridge.diag.Opaque",
    )
    assert w.invoke(["r", ref, "bump"], [5], session="refs-a") == 15
    assert w.get(["r", ref, "value"], session="refs-a") == 15
    # Used as an argument, a reference is the object itself.
    assert w.get(["r", w.call(D, "echo", ref, session="refs-a"), "value"], session="refs-a") == 15

    err = error_of(w.invoke, ["r", ref, "bump"], [1], session="refs-b")
    assert err["type"] == "bad_argument"
    assert "belongs to session 'refs-a', not to session 'refs-b'" in err["message"]
    err = error_of(w.call, D, "echo", ref)  # default session
    assert err["type"] == "bad_argument" and "belongs to session 'refs-a'" in err["message"]

    rid = next_id()
    kind, _, err = w.request(["release", rid, "refs-b", [ref]])
    assert kind == "error" and err["type"] == "bad_argument"
    rid = next_id()
    assert w.request(["release", rid, "refs-a", [ref]]) == ["ok", rid, 1]
    err = error_of(w.get, ["r", ref, "value"], session="refs-a")
    assert err["type"] == "bad_argument" and "was released" in err["message"]
    close(w, "refs-a")


def test_a_release_brings_no_session_into_being(shared_worker):
    w = shared_worker
    ref = w.call(D, "opaque", 1, session="gone-soon")
    assert close(w, "gone-soon") == {"refs": 1, "contexts": 0}
    sessions = w.ping()["sessions"]
    # A late release in the closed session (a dropped reply's, say): nothing left to
    # release, and the session does not come back.
    rid = next_id()
    assert w.request(["release", rid, "gone-soon", [ref]]) == ["ok", rid, 0]
    assert w.ping()["sessions"] == sessions
    # Still refused: a reference of another session, named in it.
    other = w.call(D, "opaque", 2, session="still-open")
    rid = next_id()
    kind, _, err = w.request(["release", rid, "gone-soon", [other]])
    assert kind == "error" and err["type"] == "bad_argument"
    assert "belongs to session 'still-open'" in err["message"]
    assert w.ping()["sessions"] == sessions + 1  # only "still-open" is new
    close(w, "still-open")


def test_a_reference_from_an_earlier_worker_is_session_lost(shared_worker):
    stale = Ref("0123456789abcdef", 1, None, "vllm_bridge.bridge.diag.Opaque")
    err = error_of(shared_worker.get, ["r", stale, "value"])
    assert err["type"] == "session_lost"
    assert "'0123456789abcdef'" in err["message"]
    err = error_of(shared_worker.call, D, "echo", [stale])
    assert err["type"] == "session_lost"


def test_unencodable_values_nest_as_references(shared_worker):
    w = shared_worker
    s = "nested"
    inner = w.call(D, "opaque", 1, session=s)
    sample = w.call(D, "Sample", "x", payload=[inner, (inner,)], session=s)
    assert isinstance(sample, Sample)
    first, (second,) = sample.payload
    assert isinstance(first, Ref) and isinstance(second, Ref)
    assert w.invoke(["r", first, "bump"], [], session=s) == 2
    assert w.get(["r", second, "value"], session=s) == 2  # the same object
    assert close(w, s) == {"refs": 3, "contexts": 0}


def test_a_generator_from_aplain_call_is_a_reference_that_can_be_streamed(shared_worker):
    gen = shared_worker.call(D, "count", 3, session="gen")
    assert isinstance(gen, Ref) and gen.type_name == "builtins.generator"
    assert shared_worker.stream(["r", gen, None], [], session="gen") == [0, 1, 2]
    close(shared_worker, "gen")


def test_the_reference_bound_is_enforced_per_worker():
    w = spawn_worker(["--max-refs", "4"])
    try:
        refs = [w.call(D, "opaque", i, session=f"bound-{i % 2}") for i in range(4)]
        assert w.ping()["refs"] == 4
        err = error_of(w.call, D, "opaque", session="bound-2")
        assert err["type"] == "bad_argument"
        assert "--max-refs 4" in err["message"]
        # A value holding several unencodable objects fails whole, leaving no reference.
        rid = next_id()
        assert w.request(["release", rid, "bound-0", [refs[0]]]) == ["ok", rid, 1]
        err = error_of(w.call, D, "echo", [refs[1], refs[1]], session="bound-1")
        assert err["type"] == "bad_argument"
        assert w.ping()["refs"] == 3
        assert isinstance(w.call(D, "opaque", session="bound-2"), Ref)
        assert close(w, "bound-1") == {"refs": 2, "contexts": 0}
        assert w.ping()["refs"] == 2
    finally:
        w.stop()


# -- context managers ----------------------------------------------------------------------


def test_exit_receives_the_real_exception_of_a_failed_call(shared_worker):
    w = shared_worker
    s = "ctx-real"
    w.call(D, "exit_log", True)
    handle, entered = w.call(D, "recorder", "real", session=s, via="enter")
    assert entered == "real"
    failure = error_of(w.call, D, "fail", "boom", "KeyError", session=s)
    assert exit_ctx(w, s, handle, failure)[0::2] == ["ok", False]
    assert w.call(D, "exit_log") == [
        {"name": "real", "type": "builtins.KeyError", "message": "'boom'"}
    ]
    close(w, s)


def test_exit_without_a_known_exception_gets_a_caller_error(shared_worker):
    w = shared_worker
    s = "ctx-caller"
    w.call(D, "exit_log", True)
    # An exc_id of another session is not this session's exception.
    other = error_of(w.call, D, "fail", "elsewhere", session="ctx-other")
    for exc in (
        {"type": "timeout", "message": "caller gave up", "exc_id": None},
        {"type": "python_exception", "message": "caller gave up", "exc_id": other["exc_id"]},
    ):
        handle, _ = w.call(D, "recorder", "c", session=s, via="enter")
        assert exit_ctx(w, s, handle, exc)[0::2] == ["ok", False]
    caller_error = {
        "name": "c",
        "type": "vllm_bridge.bridge.worker.CallerError",
        "message": "caller gave up",
    }
    assert w.call(D, "exit_log") == [caller_error, caller_error]
    close(w, s)
    close(w, "ctx-other")


def test_exit_reports_whether_the_exception_was_suppressed(shared_worker):
    w = shared_worker
    handle, _ = w.call(D, "recorder", "quiet", True, session="ctx-s", via="enter")
    assert exit_ctx(w, "ctx-s", handle, {"message": "x"})[0::2] == ["ok", True]
    close(w, "ctx-s")


def test_exit_is_refused_for_a_handle_not_entered_in_this_session(shared_worker):
    w = shared_worker
    handle, _ = w.call(D, "recorder", "h", session="ctx-a", via="enter")
    kind, _, err = exit_ctx(w, "ctx-b", handle)
    assert (kind, err["type"]) == ("error", "bad_argument")
    assert "belongs to session 'ctx-a'" in err["message"]
    assert exit_ctx(w, "ctx-a", handle)[0] == "ok"
    kind, _, err = exit_ctx(w, "ctx-a", handle)
    assert (kind, err["type"]) == ("error", "bad_argument")
    assert "was released or never existed" in err["message"]
    opaque = w.call(D, "opaque", session="ctx-a")
    kind, _, err = exit_ctx(w, "ctx-a", opaque)
    assert "is not an entered context of session 'ctx-a'" in err["message"]
    close(w, "ctx-a")


def test_only_the_last_64_exceptions_are_kept(shared_worker):
    w = shared_worker
    s = "ctx-many"
    w.call(D, "exit_log", True)
    first = error_of(w.call, D, "fail", "first", session=s)
    for i in range(64):
        error_of(w.call, D, "fail", f"later {i}", session=s)
    handle, _ = w.call(D, "recorder", "old", session=s, via="enter")
    exit_ctx(w, s, handle, first)
    assert w.call(D, "exit_log")[0]["type"] == "vllm_bridge.bridge.worker.CallerError"
    close(w, s)


def test_close_exits_the_contexts_newest_first(shared_worker):
    w = shared_worker
    s = "ctx-close"
    w.call(D, "exit_log", True)
    for name in ("a", "b", "c"):
        w.call(D, "recorder", name, session=s, via="enter")
    w.call(D, "opaque", session=s)
    assert close(w, s) == {"refs": 4, "contexts": 3}
    assert [e["name"] for e in w.call(D, "exit_log")] == ["c", "b", "a"]
    assert all(e["type"] is None for e in w.call(D, "exit_log"))


def test_releasing_a_handle_exits_its_context(shared_worker):
    w = shared_worker
    w.call(D, "exit_log", True)
    handle, _ = w.call(D, "recorder", "released", session="ctx-r", via="enter")
    rid = next_id()
    assert w.request(["release", rid, "ctx-r", [handle]]) == ["ok", rid, 1]
    assert w.call(D, "exit_log") == [{"name": "released", "type": None, "message": None}]
    assert close(w, "ctx-r") == {"refs": 0, "contexts": 0}


def test_enter_refuses_what_is_not_a_context_manager(shared_worker):
    err = error_of(shared_worker.call, D, "opaque", session="ctx-n", via="enter")
    assert err["type"] == "bad_argument"
    assert "vllm_bridge.bridge.diag.Opaque, which is not a context manager" in err["message"]
    assert close(shared_worker, "ctx-n") == {"refs": 0, "contexts": 0}
