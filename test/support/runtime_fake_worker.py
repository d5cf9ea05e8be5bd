"""A stand-in worker for tests of the Elixir runtime (test/runtime/worker_test.exs,
test/runtime/frame_limit_test.exs).

The real worker cannot be made to speak another protocol version, to hang before its
handshake or to send a frame header over the limit, so this one does, on purpose, as
``FAKE_WORKER_MODE`` says:

* ``version`` - announce protocol version 99, then wait for EOF on fd 3;
* ``silent``  - announce nothing and wait for EOF on fd 3;
* ``crash``   - exit with status 3 before any handshake;
* ``limit``   - announce a ``max_frame_bytes`` other than the one it was given;
* ``huge_header`` - a valid hello, then read ``FAKE_WORKER_CALLS`` requests (default 2)
  without answering them, then write a header declaring ``FAKE_WORKER_DECLARE`` bytes
  (default 4 GiB - 1) and a few bytes of "body", and wait for EOF (or to be killed).
  With ``FAKE_WORKER_ANSWER=1`` the requests are answered (``["ok", id, "answered"]``)
  in the same write as the header, before it; with ``FAKE_WORKER_LINGER=1`` it sleeps
  two minutes after the header instead of reading fd 3 (only a kill ends it sooner).
* ``hello_chunk`` - one write holding the hello, a log record ("first") and the first
  two bytes of a second record's header; a moment later the rest of that record
  ("second"); then answer every request with ``["ok", id, "served"]`` until EOF.
* ``deaf``    - a valid hello, then close fd 3 (a write to the port then fails with
  ``EPIPE``) and wait to be killed; with ``FAKE_WORKER_QUIET=1`` it first points its
  stdout and stderr at ``/dev/null`` (its output FIFOs end while it stays).
* ``window``  - a hello announcing ``stream_window`` ``FAKE_WORKER_WINDOW`` (default 4);
  then answer each ``stream`` request with ``FAKE_WORKER_CHUNKS`` chunks (default 20,
  the integers from 0), never more than the window ahead of the credits it has read,
  then a last chunk (also within the window): the list of the credits it read, and the
  end. Other requests are
  ignored. A reader that does not take the window from the hello stalls it.
* ``serve``   - a valid hello, then answer every request with ``["ok", id, "served"]``
  until EOF.
* ``off_protocol`` - a valid hello, then answers off the protocol that hold references:
  a ``stream`` gets ``ok`` (a reply a stream never gets) holding two of its own
  instance's references (one of them twice) and one of another instance; an ``enter``
  gets ``ok`` with a map, not ``[handle, value]``, holding reference 7 of the enter's
  session; a ``release`` naming reference 100 gets a map holding reference 8, any other
  the number it names. It keeps every ``release`` it reads and answers a ``call`` with
  them, each ``[session, [[instance, id, session, type], ...]]``.
* ``bad_logs`` - as ``serve``, but before each answer write one ``log`` frame of each
  shape a careless worker might send (``FAKE_WORKER_LOG_CASES``, below).

Whatever the mode, ``FAKE_WORKER_HELLO_PID`` (an integer) is the ``pid`` its hello
announces in place of its own (a worker that lies about its process), and
``FAKE_WORKER_HELLO_EXTRA`` (a Python literal of a dict) is merged into its hello.
"""

from __future__ import annotations

import ast
import os
import struct
import sys
import time

import msgpack


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _write(body: bytes) -> None:
    os.write(4, _frame(body))


def _wait_for_eof() -> None:
    while os.read(3, 65536):
        pass


def _read_exact(n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(3, n - len(data))
        if not chunk:
            raise EOFError("fd 3 closed")
        data += chunk
    return data


def _request_id() -> int:
    """Read one request frame; its id (raises ``EOFError`` at EOF)."""
    (length,) = struct.unpack(">I", _read_exact(4))
    request = msgpack.unpackb(_read_exact(length), raw=False, strict_map_key=False)
    return int(request[1])


def _request() -> list[object]:
    """Read one request frame (raises ``EOFError`` at EOF)."""
    (length,) = struct.unpack(">I", _read_exact(4))
    return list(msgpack.unpackb(_read_exact(length), raw=False, strict_map_key=False))


def _serve_windowed() -> int:
    """The ``window`` mode: streams that keep to the window they announce."""
    window = int(os.environ.get("FAKE_WORKER_WINDOW", "4"))
    chunks = int(os.environ.get("FAKE_WORKER_CHUNKS", "20"))
    _write(msgpack.packb(["hello", _hello(stream_window=window)]))
    try:
        while True:
            request = _request()
            if request[0] != "stream":
                continue
            stream_id = int(request[1])
            room, credits = window, []
            for i in range(chunks + 1):
                while room == 0:
                    credit = _request()
                    if credit[0] == "credit" and credit[1] == stream_id:
                        room += int(credit[2])
                        credits.append(int(credit[2]))
                value: object = i if i < chunks else credits
                _write(msgpack.packb(["chunk", stream_id, value]))
                room -= 1
            _write(msgpack.packb(["end", stream_id]))
    except EOFError:
        return 0


def _ref(instance: str, ref_id: int, session: object = None) -> msgpack.ExtType:
    return msgpack.ExtType(6, msgpack.packb([instance, ref_id, session, "object"]))


def _serve_off_protocol() -> int:
    """The ``off_protocol`` mode: answers of the wrong shape, with references in them."""
    hello = _hello()
    own = str(hello["instance"])
    _write(msgpack.packb(["hello", hello]))
    releases: list[list[object]] = []
    try:
        while True:
            request = _request()
            kind, request_id = request[0], request[1]
            value: object
            if kind == "stream":
                mine, other = _ref(own, 5), _ref("ff" * 8, 9)
                value = {"a": mine, "b": [mine, _ref(own, 6)], "c": other}
            elif kind == "enter":
                value = {"x": _ref(own, 7, request[2])}
            elif kind == "release":
                refs = [msgpack.unpackb(r.data, raw=False) for r in request[-1]]
                releases.append([request[-2], refs])
                named = {ref[1] for ref in refs}
                value = {"z": _ref(own, 8)} if 100 in named else len(refs)
            elif kind == "call":
                value = releases
            else:
                continue
            _write(msgpack.packb(["ok", request_id, value]))
    except EOFError:
        return 0

def _hello(**extra: object) -> dict[str, object]:
    pid = int(os.environ.get("FAKE_WORKER_HELLO_PID", os.getpid()))
    more = ast.literal_eval(os.environ.get("FAKE_WORKER_HELLO_EXTRA", "{}"))
    return {"protocol": 1, "pid": pid, "instance": os.urandom(8).hex(), **extra, **more}


# ``log`` frames of the wrong shape: a level, logger name or message that is not a
# string, a frame too short or too long, a huge message.
BAD_LOGS: list[list[object]] = [
    ["log", "error", {"a": 1}, "msg"],
    ["log", "error", "name", {"a": 1}],
    ["log", "error", ["a", 1], ["b", 2]],
    ["log", 7, 8, 9],
    ["log", {"level": 1}, "name", "msg"],
    ["log", "error", "name", b"\xff" * 3_000_000],
    ["log", "error", "x" * 3_000_000, "msg"],
    ["log", "error"],
    ["log"],
    ["log", "error", "name", "msg", "extra"],
    ["log", None, None, None],
]


def _serve(bad_logs: bool) -> int:
    """The ``serve`` and ``bad_logs`` modes."""
    _write(msgpack.packb(["hello", _hello()]))
    try:
        while True:
            request_id = _request_id()
            out = b""
            if bad_logs:
                out = b"".join(_frame(msgpack.packb(log)) for log in BAD_LOGS)
            os.write(4, out + _frame(msgpack.packb(["ok", request_id, "served"])))
    except EOFError:
        return 0


def main() -> int:
    """Behave as ``FAKE_WORKER_MODE`` says."""
    mode = os.environ.get("FAKE_WORKER_MODE", "")
    if mode == "version":
        hello = {"protocol": 99, "pid": os.getpid(), "instance": "00" * 8}
        _write(msgpack.packb(["hello", hello]))
        _wait_for_eof()
        return 0
    if mode == "silent":
        _wait_for_eof()
        return 0
    if mode == "crash":
        return 3
    if mode == "limit":
        _write(msgpack.packb(["hello", _hello(max_frame_bytes=12345)]))
        _wait_for_eof()
        return 0
    if mode == "huge_header":
        _write(msgpack.packb(["hello", _hello()]))
        answer = os.environ.get("FAKE_WORKER_ANSWER") == "1"
        answers = b""
        try:
            for _ in range(int(os.environ.get("FAKE_WORKER_CALLS", "2"))):
                request_id = _request_id()
                if answer:
                    answers += _frame(msgpack.packb(["ok", request_id, "answered"]))
        except EOFError:  # stopped before the calls came (the pool stopped)
            return 0
        declared = int(os.environ.get("FAKE_WORKER_DECLARE", str(0xFFFF_FFFF)))
        os.write(4, answers + struct.pack(">I", declared) + b"\x93" * 100)
        if os.environ.get("FAKE_WORKER_LINGER") == "1":
            time.sleep(120)  # deaf to EOF: only a kill ends it in time
        _wait_for_eof()
        return 0
    if mode == "hello_chunk":
        second = _frame(msgpack.packb(["log", "warning", "fake", "second"]))
        os.write(
            4,
            _frame(msgpack.packb(["hello", _hello()]))
            + _frame(msgpack.packb(["log", "warning", "fake", "first"]))
            + second[:2],
        )
        time.sleep(0.2)  # the rest comes in a chunk of its own (not needed to pass)
        os.write(4, second[2:])
        try:
            while True:
                os.write(4, _frame(msgpack.packb(["ok", _request_id(), "served"])))
        except EOFError:
            return 0
    if mode == "deaf":
        _write(msgpack.packb(["hello", _hello()]))
        if os.environ.get("FAKE_WORKER_QUIET") == "1":
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):
                os.dup2(devnull, fd)
            os.close(devnull)
        os.close(3)
        time.sleep(120)  # killed long before (Launcher.close, after shutdown_grace)
        return 0
    if mode == "window":
        return _serve_windowed()
    if mode == "off_protocol":
        return _serve_off_protocol()
    if mode in ("serve", "bad_logs"):
        return _serve(mode == "bad_logs")
    sys.stderr.write(f"runtime_fake_worker: unknown FAKE_WORKER_MODE {mode!r}\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
