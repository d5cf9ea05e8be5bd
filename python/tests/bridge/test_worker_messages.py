"""Every message kind against a real worker, the allow-list, and error replies."""

from __future__ import annotations

import re
import subprocess
import struct

import msgpack
import pytest
import torch
from conftest import WorkerCallError, next_id, same, spawn_worker, tensor_bytes

from vllm_bridge import PROTOCOL_VERSION, PUBLIC_MODULES
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.bridge.diag import Level, Sample
from vllm_bridge.forward_context import BatchDescriptor
from vllm_bridge.bridge.protocol import Atom, Ref, packb, unpackb
from vllm_bridge.bridge.protocol.tensors import CODE_TO_DTYPE

D = "vllm_bridge.bridge.diag"


def error_of(fn, *args, **kwargs) -> dict:
    with pytest.raises(WorkerCallError) as info:
        fn(*args, **kwargs)
    return info.value.error


def test_hello_announces_the_worker(shared_worker):
    hello = shared_worker.hello
    assert hello["protocol"] == PROTOCOL_VERSION
    assert re.fullmatch(r"[0-9a-f]{16}", hello["instance"])
    assert {"stream", "context", "cancel"} <= set(hello["capabilities"])
    assert hello["modules"] == list(PUBLIC_MODULES)
    assert hello["import_errors"] == {}


def test_hello_from_the_caller_checks_the_protocol_version(shared_worker):
    rid = next_id()
    assert shared_worker.request(["hello", rid, {"protocol": PROTOCOL_VERSION}]) == [
        "ok",
        rid,
        {"protocol": PROTOCOL_VERSION},
    ]
    rid = next_id()
    kind, got, err = shared_worker.request(["hello", rid, {"protocol": 2}])
    assert (kind, got, err["type"]) == ("error", rid, "protocol")
    assert "protocol version 2" in err["message"]


def test_call_get_and_constructor(shared_worker):
    assert shared_worker.call(D, "add", 40, 2) == 42
    assert shared_worker.call(D, "add", a=1.5, b=2) == 3.5
    assert same(shared_worker.call(D, "Sample", "s", payload=(1,)), Sample("s", payload=(1,)))
    assert same(shared_worker.get(["m", D, "Level.HIGH"]), Level.HIGH)
    assert shared_worker.get(["m", D, "Level.HIGH.value"]) == 2


def test_ok_error_and_exc_ids(shared_worker):
    err = error_of(shared_worker.call, D, "fail", "boom", kind="RuntimeError")
    assert err["type"] == "python_exception"
    assert err["message"] == "boom"
    assert err["python_type"] == "RuntimeError"
    assert "Traceback" in err["traceback"] and "in fail" in err["traceback"]
    assert isinstance(err["exc_id"], int)
    again = error_of(shared_worker.call, D, "fail", "boom")
    assert again["exc_id"] > err["exc_id"]
    assert shared_worker.call(D, "add", 1, 1) == 2  # still serving


def test_stream_sends_chunks_then_end(shared_worker):
    assert shared_worker.stream(["m", D, "count"], [5]) == [0, 1, 2, 3, 4]
    assert shared_worker.stream(["m", D, "count"], [0]) == []


def test_stream_of_something_not_iterable_is_refused(shared_worker):
    err = error_of(shared_worker.stream, ["m", D, "add"], [1, 2])
    assert err["type"] == "bad_argument"
    assert "builtins.int" in err["message"] and "not iterable" in err["message"]


def test_stream_failing_midway_ends_with_an_error(shared_worker):
    rid = next_id()
    shared_worker.send(["stream", rid, None, 30_000, ["m", D, "count"], [3, -1.0], {}])
    kind, got, err = shared_worker.reply(rid)
    assert (kind, got, err["type"]) == ("error", rid, "python_exception")
    assert "delay must be a non-negative number" in err["message"]


def test_enter_exit_release_close(shared_worker):
    s = "messages-ctx"
    handle, value = shared_worker.call(D, "recorder", "m1", session=s, via="enter")
    assert value == "m1"
    assert isinstance(handle, Ref) and handle.type_name == "context" and handle.session == s
    rid = next_id()
    assert shared_worker.request(["exit", rid, s, 5000, handle, None]) == ["ok", rid, False]
    ref = shared_worker.call(D, "opaque", session=s)
    rid = next_id()
    assert shared_worker.request(["release", rid, s, [ref, ref]]) == ["ok", rid, 1]
    rid = next_id()
    assert shared_worker.request(["close", rid, s]) == ["ok", rid, {"refs": 0, "contexts": 0}]
    rid = next_id()
    assert shared_worker.request(["close", rid, "never-used"]) == [
        "ok",
        rid,
        {"refs": 0, "contexts": 0},
    ]


def test_ping_reports_status(shared_worker):
    status = shared_worker.ping()
    assert set(status) == {"running", "running_for", "queued", "sessions", "refs", "cuda"}
    assert status["running"] is None and status["running_for"] is None
    assert status["queued"] == 0
    # Nothing initialised CUDA in this worker: a status does not either.
    assert status["cuda"] is None


def test_log_records_become_log_frames(shared_worker):
    shared_worker.logs.clear()
    shared_worker.call(D, "log", "careful", level="warning")
    shared_worker.call(D, "log", "not forwarded", level="info")
    assert shared_worker.logs == [["log", "warning", "vllm_bridge.bridge.diag", "careful"]]


def test_forwarded_records_are_not_also_printed_on_stderr():
    w = spawn_worker(stderr=subprocess.PIPE)
    try:
        w.call(D, "log", "sent as a frame only", level="error")
        assert w.logs == [["log", "error", "vllm_bridge.bridge.diag", "sent as a frame only"]]
        w.close()
        assert w.proc.wait(timeout=30) == 0
        stderr = w.proc.stderr.read().decode()
        assert "sent as a frame only" not in stderr
        assert "fd 3 closed" not in stderr  # a routine shutdown says nothing
    finally:
        w.stop()


# -- targets and the allow-list -----------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "path", "needle"),
    [
        ("os", "getcwd", "module 'os' is not in the worker's allow-list"),
        ("builtins", "eval", "module 'builtins' is not in the worker's allow-list"),
        (D, "os.system", "vllm_bridge.bridge.diag.os is the module 'os'"),
        (D, "__builtins__", "'__builtins__' of vllm_bridge.bridge.diag is unreachable"),
        (D, "add.__globals__", "'__globals__' of vllm_bridge.bridge.diag.add is unreachable"),
        (D, "nope", "vllm_bridge.bridge.diag has no attribute 'nope'"),
        (D, "Level..HIGH", "has an empty part"),
        (D, "", "empty attribute path"),
    ],
)
def test_targets_outside_the_allow_list_are_refused_by_name(shared_worker, module, path, needle):
    err = error_of(shared_worker.call, module, path)
    assert err["type"] == "bad_argument"
    assert needle in err["message"]


def test_a_single_leading_underscore_is_reachable(shared_worker):
    assert shared_worker.call(D, "_check_seconds", "x", 2) == 2.0


def test_calling_something_not_callable_is_refused(shared_worker):
    err = error_of(shared_worker.call, D, "Level.HIGH.value")
    assert err["type"] == "bad_argument" and "not callable" in err["message"]


def test_a_narrow_allow_list_refuses_the_other_public_modules():
    wp = spawn_worker(["--allow", D])
    try:
        assert wp.hello["modules"] == [D]
        err = error_of(wp.call, "vllm_bridge.cudagraph", "cudagraph_mode_from", "full")
        assert err["type"] == "bad_argument"
        assert "'vllm_bridge.cudagraph' is not in the worker's allow-list" in err["message"]
        # Only classes of allow-listed modules are built from the wire.
        err = error_of(wp.call, D, "echo", BatchDescriptor(num_tokens=8))
        assert err["type"] == "bad_argument"
        assert "unknown class 'vllm_bridge.forward_context.BatchDescriptor'" in err["message"]
        assert same(wp.call(D, "echo", Sample("a")), Sample("a"))
    finally:
        wp.stop()


def test_atoms_become_enum_members_by_annotation(shared_worker):
    assert shared_worker.call(D, "level_name", Atom("high")) == "HIGH"
    assert shared_worker.call(D, "level_name", level=Atom("Low")) == "LOW"
    full = ["m", "vllm_bridge.cudagraph", "CUDAGraphMode.FULL_AND_PIECEWISE.has_mode"]
    assert shared_worker.invoke(full, [Atom("full")]) is True
    config = shared_worker.call(
        "vllm_bridge.config", "CompilationConfig", cudagraph_mode=Atom("full")
    )
    assert config.cudagraph_mode is CUDAGraphMode.FULL
    err = error_of(shared_worker.call, D, "level_name", Atom("mid"))
    assert err["type"] == "bad_argument"
    assert ":mid is not a member of vllm_bridge.bridge.diag.Level (LOW, HIGH)" in err["message"]
    # A plain string is not an atom: it reaches the function unchanged.
    assert error_of(shared_worker.call, D, "level_name", "high")["python_type"] == "TypeError"


# -- malformed frames ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "request_id", "error_type", "needle"),
    [
        (b"\xc1", None, "protocol", "undecodable frame"),
        (b"", None, "protocol", "undecodable frame"),
        (b"\x93\x01", None, "protocol", "undecodable frame"),
        (packb({"call": 1}), None, "protocol", "non-empty array"),
        (packb(["launch", 5]), 5, "protocol", "unknown message kind 'launch'"),
        (packb(["ping"]), None, "protocol", "has 1 fields after the kind, got 0"),
        (packb(["ping", -1]), None, "protocol", "id must be a non-negative integer"),
        (packb(["call", 6, 3, None, ["m", D, "add"], [], {}]), 6, "protocol", "session"),
        (packb(["call", 7, None, "soon", ["m", D, "add"], [], {}]), 7, "protocol", "timeout"),
        (packb(["call", 8, None, None, ["x", D, "add"], [], {}]), 8, "protocol", "target"),
        (packb(["call", 9, None, None, ["m", D, "add"], {}, {}]), 9, "protocol", "args"),
        (packb(["call", 10, None, None, ["m", D, "add"], [], {1: 2}]), 10, "protocol", "kwargs"),
        (packb(["exit", 11, None, None, 5, None]), 11, "protocol", "handle"),
        (packb(["release", 12, None, [1]]), 12, "protocol", "array of references"),
        (
            b"\x97\xa4call\x0d\xc0\xc0" + packb(["m", D, "echo"]) + b"\x91\xd4\x09\x00\x80",
            13,
            "bad_argument",
            "unknown extension type code 9",
        ),
        (  # msgpack's timestamp (ext -1), which msgpack decodes without the ext hook
            msgpack.packb(["call", 14, None, None, ["m", D, "echo"], [msgpack.Timestamp(1, 0)],
                           {}]),  # fmt: skip
            14,
            "bad_argument",
            "could not decode args[0]: unknown extension type code -1",
        ),
    ],
)
def test_malformed_frames_get_an_error_and_the_worker_keeps_serving(
    shared_worker, body, request_id, error_type, needle
):
    shared_worker.send_raw(body)
    kind, got, err = shared_worker.recv()
    assert (kind, got, err["type"]) == ("error", request_id, error_type)
    assert needle in err["message"]
    assert shared_worker.call(D, "add", 2, 3) == 5


def _echo_values() -> list:
    float_bits = (
        0x7FF8000000000000,  # NaN
        0x7FF8000000000001,  # NaN with a payload
        0xFFF0000000000000,  # -inf
        0x7FF0000000000000,  # +inf
        0x8000000000000000,  # -0.0
        0x0000000000000001,  # smallest subnormal
    )
    floats = [struct.unpack(">d", struct.pack(">Q", bits))[0] for bits in float_bits]
    gen = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    tensors = [
        (raw % 2).to(torch.bool) if dtype == torch.bool else raw.view(dtype)
        for dtype in CODE_TO_DTYPE.values()
    ]
    odd = [
        torch.empty((0, 3), dtype=torch.bfloat16),
        torch.tensor(2.5, dtype=torch.float64),
        torch.arange(12, dtype=torch.int8).reshape(3, 4).t(),  # not contiguous
        raw.view(torch.bfloat16)[::3],  # not contiguous, NaN patterns included
        torch.arange(1 << 15, dtype=torch.float64),  # large: written from its memory
    ]
    big = [2**64, -(2**64) - 1, 2**200 + 1, 2**63 - 1, -(2**63)]
    other = [Atom("full"), (1, (Atom("x"), [])), Sample("s", Level.HIGH, (2.5,)), Level.LOW]
    return [*floats, *tensors, *odd, *big, *other]


def test_every_extension_type_comes_back_bit_exact_through_echo(shared_worker):
    for value in _echo_values():
        rid = next_id()
        shared_worker.send(["call", rid, None, 30_000, ["m", D, "echo"], [value], {}])
        body = shared_worker.recv_raw()
        assert body == packb(["ok", rid, value]), repr(value)[:80]
        assert same(unpackb(body)[2], value.contiguous() if torch.is_tensor(value) else value)


@pytest.mark.parametrize("numel", [6, 1 << 16])  # inline, and written from its own memory
def test_a_tensor_on_the_workers_device_comes_back_by_value(shared_worker, numel):
    """On a GPU machine the result is a CUDA tensor: copied to the host, device recorded."""
    device = shared_worker.hello["device"]
    t = torch.arange(numel, dtype=torch.float32).reshape(2, -1).t()  # not contiguous
    rid = next_id()
    shared_worker.send(["call", rid, None, 30_000, ["m", D, "to_device"], [t], {}])
    body = shared_worker.recv_raw()
    name = b"" if device == "cpu" else device.encode()
    header = bytes((8, 2, len(name))) + name + struct.pack(">QQ", *t.shape)
    payload = header + tensor_bytes(t.contiguous())
    assert body == msgpack.packb(["ok", rid, msgpack.ExtType(3, payload)])


def test_frames_are_read_whole_even_when_large(shared_worker):
    blob = bytes(range(256)) * 40_000  # 10 MB
    assert shared_worker.call(D, "echo", blob) == blob
    assert msgpack.unpackb(packb(blob)) == blob


def test_the_hello_names_allow_listed_modules_that_failed_to_import():
    wp = spawn_worker(["--allow", D, "vllm_bridge.no_such_module"])
    try:
        assert wp.hello["import_errors"] == {
            "vllm_bridge.no_such_module": "ModuleNotFoundError: No module named "
            "'vllm_bridge.no_such_module'"
        }
        assert wp.call(D, "add", 1, 2) == 3  # the worker itself still serves
    finally:
        wp.stop()
