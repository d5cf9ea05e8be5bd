"""The execution model against a real worker: one call at a time in arrival order, pings
answered while a call runs, cancel of queued calls and of streams, deadlines. (Cancel of
a running call, which interrupts it: test_worker_cancel.py.)"""

from __future__ import annotations

from conftest import next_id

D = "vllm_bridge.bridge.diag"


def send_call(w, path, args, session=None, timeout=30_000) -> int:
    rid = next_id()
    w.send(["call", rid, session, timeout, ["m", D, path], args, {}])
    return rid


def wait_running(w, rid) -> dict:
    """Ping until the worker reports ``rid`` running (bounded by the frame wait)."""
    for _ in range(10_000):
        status = w.ping()
        if status["running"] == rid:
            return status
    raise AssertionError(f"call {rid} never ran")


def test_pings_are_answered_while_a_long_call_runs(shared_worker):
    w = shared_worker
    slow = send_call(w, "sleep", [2.0])
    status = wait_running(w, slow)
    # The pong came while the call still ran: its reply has not arrived yet.
    assert not any(m[1] == slow for m in w.inbox)
    assert status["queued"] == 0
    queued = send_call(w, "add", [1, 2])
    assert w.ping()["queued"] == 1
    assert w.reply(slow) == ["ok", slow, 2.0]
    assert w.reply(queued) == ["ok", queued, 3]


def test_calls_run_one_at_a_time_in_arrival_order(shared_worker):
    w = shared_worker
    assert w.inbox == []
    ids = [send_call(w, "set_var", [i], session="order") for i in range(20)]
    replies = [w.recv() for _ in ids]  # in the order they arrive
    assert [r[1] for r in replies] == ids
    # Each call saw the value its predecessor set.
    assert [r[2] for r in replies] == [None] + list(range(19))


def test_a_queued_call_that_is_cancelled_is_dropped(shared_worker):
    w = shared_worker
    slow = send_call(w, "sleep", [2.0])  # long enough for the next three frames to arrive
    wait_running(w, slow)
    dropped = send_call(w, "set_var", ["must not run"], session="cancel-q")
    kept = send_call(w, "get_var", [], session="cancel-q")
    w.send(["cancel", dropped])
    kind, got, err = w.reply(dropped)
    assert (kind, got, err["type"]) == ("error", dropped, "cancelled")
    assert w.reply(slow) == ["ok", slow, 2.0]
    assert w.reply(kept) == ["ok", kept, None]  # the cancelled call never ran


def test_cancel_of_an_unknown_id_is_ignored(shared_worker):
    w = shared_worker
    w.send(["cancel", 987_654_321])
    assert w.ping()["running"] is None
    assert w.call(D, "add", 1, 1) == 2
    assert w.inbox == []


def test_a_stream_cancelled_between_chunks_stops_and_closes_its_generator(shared_worker):
    """Between chunks (here: waiting for credit, its window sent) no code of the stream
    runs: the cancel stops it there and its generator is closed (``GeneratorExit``).
    Cancelled while its generator computes a chunk, it is interrupted inside it instead
    (test_worker_cancel.py)."""
    from vllm_bridge.bridge.protocol.flow import STREAM_WINDOW

    w = shared_worker
    w.call(D, "exit_log", True)
    rid = next_id()
    w.send(["stream", rid, None, 30_000, ["m", D, "count"], [10_000, 0.0, "cancelled"], {}])
    assert [w.reply(rid) for _ in range(STREAM_WINDOW)] == [
        ["chunk", rid, i] for i in range(STREAM_WINDOW)
    ]
    assert w.ping()["running"] == rid  # waiting for credit
    w.send(["cancel", rid])
    frame = w.reply(rid)
    assert frame[0] == "error" and frame[2]["type"] == "cancelled"
    assert w.call(D, "exit_log") == [
        {"name": "cancelled", "type": "builtins.GeneratorExit", "message": ""}
    ]


def test_an_enter_cancelled_while_entering_exits_the_context_again(shared_worker):
    w = shared_worker
    w.call(D, "exit_log", True)
    refs = w.ping()["refs"]
    rid = next_id()
    w.send(["enter", rid, "slow-enter", 30_000, ["m", D, "recorder"], ["late", False, 0.3], {}])
    wait_running(w, rid)
    w.send(["cancel", rid])
    kind, got, err = w.reply(rid)
    assert (kind, got, err["type"]) == ("error", rid, "cancelled")
    assert "the context was exited again" in err["message"]
    # Exited cleanly, and the session is left as it was: nothing entered, no handle kept.
    assert w.call(D, "exit_log") == [{"name": "late", "type": None, "message": None}]
    assert w.call(D, "get_var", session="slow-enter") is None
    assert w.ping()["refs"] == refs


def test_a_cancel_of_a_finished_enter_exits_its_context_before_later_requests(shared_worker):
    w = shared_worker
    w.call(D, "exit_log", True)
    refs = w.ping()["refs"]
    rid = next_id()
    w.send(["enter", rid, "done-enter", 30_000, ["m", D, "recorder"], ["done"], {}])
    kind, _, (handle, value) = w.reply(rid)
    assert (kind, value) == ("ok", "done")
    # The caller gave up anyway (its cancel crossed the reply): the next request of the
    # session, sent right after the cancel, already runs outside the context.
    w.send(["cancel", rid])
    assert w.call(D, "get_var", session="done-enter") is None
    assert w.call(D, "exit_log") == [{"name": "done", "type": None, "message": None}]
    assert w.ping()["refs"] == refs
    # Its handle is gone with it; a cancel of an id that entered nothing changes nothing.
    w.send(["exit", next_id(), "done-enter", 30_000, handle, None])
    assert w.recv()[2]["type"] == "bad_argument"
    w.send(["cancel", rid])
    assert w.call(D, "add", 1, 1) == 2
    assert w.inbox == []


def test_a_stream_sends_a_window_of_chunks_ahead_then_waits_for_credit(shared_worker):
    from vllm_bridge.bridge.protocol.flow import STREAM_WINDOW

    w = shared_worker
    rid = next_id()
    w.send(["stream", rid, None, 30_000, ["m", D, "count"], [1000], {}])
    got = [w.reply(rid) for _ in range(STREAM_WINDOW)]
    assert got == [["chunk", rid, i] for i in range(STREAM_WINDOW)]
    # No credit yet: the generator waits (still running), and nothing more comes.
    for _ in range(3):
        assert w.ping()["running"] == rid
    assert not any(m[1] == rid for m in w.inbox)
    w.send(["credit", rid, 5])
    assert [w.reply(rid) for _ in range(5)] == [
        ["chunk", rid, i] for i in range(STREAM_WINDOW, STREAM_WINDOW + 5)
    ]
    assert w.ping()["running"] == rid
    assert not any(m[1] == rid for m in w.inbox)
    # A cancel reaches a stream that waits for credit.
    w.send(["cancel", rid])
    assert w.reply(rid)[0:1] == ["error"]
    assert w.ping()["running"] is None


def test_a_stream_waiting_for_credit_runs_on_when_a_request_waits_behind_it(shared_worker):
    from vllm_bridge.bridge.protocol.flow import STREAM_WINDOW

    w = shared_worker
    rid = next_id()
    n = STREAM_WINDOW + 8
    w.send(["stream", rid, None, 30_000, ["m", D, "count"], [n], {}])
    assert [w.reply(rid) for _ in range(STREAM_WINDOW)] == [
        ["chunk", rid, i] for i in range(STREAM_WINDOW)
    ]
    assert w.ping()["running"] == rid  # waiting for credit
    # The reader now waits for a call of its own, queued behind the stream: the stream
    # must not wait for a credit that would only come after that call.
    add = send_call(w, "add", [2, 3])
    rest = [w.reply(rid) for _ in range(n - STREAM_WINDOW)]
    assert rest == [["chunk", rid, i] for i in range(STREAM_WINDOW, n)]
    assert w.reply(rid) == ["end", rid]
    assert w.reply(add) == ["ok", add, 5]


def test_a_credit_must_be_a_positive_count(shared_worker):
    w = shared_worker
    for bad in (0, -1, "3", True, None):
        rid = next_id()
        w.send(["credit", rid, bad])
        kind, got, err = w.reply(rid)
        assert (kind, got, err["type"]) == ("error", rid, "protocol")
        assert "credit n must be a positive integer" in err["message"]
    w.send(["credit", 987_654_321, 4])  # no such stream: ignored
    assert w.call(D, "add", 1, 1) == 2
    assert w.inbox == []


def test_a_queued_stream_that_is_cancelled_never_starts(shared_worker):
    w = shared_worker
    w.call(D, "exit_log", True)
    slow = send_call(w, "sleep", [2.0])
    wait_running(w, slow)
    rid = next_id()
    w.send(["stream", rid, None, 30_000, ["m", D, "count"], [3, 0, "never"], {}])
    w.send(["cancel", rid])
    assert w.reply(rid)[2]["type"] == "cancelled"
    assert w.reply(slow)[0] == "ok"
    assert w.call(D, "exit_log") == []


def test_a_call_whose_deadline_passed_in_the_queue_is_not_started(shared_worker):
    w = shared_worker
    slow = send_call(w, "sleep", [1.0])
    wait_running(w, slow)
    late = send_call(w, "set_var", ["must not run"], session="deadline", timeout=100)
    patient = send_call(w, "get_var", [], session="deadline", timeout=None)
    kind, got, err = w.reply(late)
    assert (kind, got, err["type"]) == ("error", late, "timeout")
    assert f"call {late} was not started" in err["message"]
    assert w.reply(slow)[0] == "ok"
    assert w.reply(patient) == ["ok", patient, None]


def test_a_call_sent_with_no_time_left_is_not_started(shared_worker):
    w = shared_worker
    for timeout in (0, -5):
        rid = send_call(w, "set_var", ["must not run"], session="deadline-0", timeout=timeout)
        assert w.reply(rid)[2]["type"] == "timeout"
    assert w.call(D, "get_var", session="deadline-0") is None


def test_the_reading_role_goes_back_and_forth_between_long_and_short_calls(shared_worker):
    """A long call hands reading to the watcher (pings answered); afterwards the execution
    thread reads again (a burst of short calls), and the next long call hands over again."""
    w = shared_worker
    for round_ in range(3):
        slow = send_call(w, "sleep", [0.3])
        status = wait_running(w, slow)
        assert status["running"] == slow
        assert w.reply(slow) == ["ok", slow, 0.3]
        burst = [send_call(w, "add", [round_, i]) for i in range(100)]
        assert [w.reply(rid) for rid in burst] == [["ok", rid, round_ + i] for i, rid in
                                                     enumerate(burst)]
        assert w.ping()["running"] is None


def test_every_call_runs_on_one_thread_whoever_read_it(shared_worker):
    """Requests read by the execution thread itself, and requests the watcher read and
    queued during a long call, all run on the same thread (a per-thread CUDA device or
    context stays valid from call to call)."""
    w = shared_worker
    first = w.call(D, "thread_id")
    slow = send_call(w, "sleep", [0.3])
    wait_running(w, slow)  # the watcher reads now
    queued = [send_call(w, "thread_id", []) for _ in range(5)]
    assert w.reply(slow)[0] == "ok"
    ids = [w.reply(rid)[2] for rid in queued]
    ids += [w.call(D, "thread_id") for _ in range(20)]
    assert set(ids) == {first}
