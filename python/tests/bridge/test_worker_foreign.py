"""A result that holds a ``msgpack.ExtType`` is never sent: msgpack would pack it by itself
as one of the protocol's own values (a reference, a tensor in a result slot naming any
file, ...), so the worker answers the request with an error naming it and where it sits,
through the common call's lane and the general path alike, and serves on.

Generated results (foreign_support.py) hold an ext of every code, 0-127 and negative, at
generated places (lists, tuples, dict keys and values, dataclass fields); each is asked
for by a ``call`` (run by the lane once the function is vetted, and by a worker without
the lane), some by a ``stream`` (the second chunk) and an ``enter`` (the entered value),
in a real execution loop over a file of frames. The same results with plain bytes in the
ext's place are answered byte for byte as the encoder answers without the check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import foreign_support
import msgpack
import pytest
from conftest import run_loop, split_frames
from foreign_support import CODES, pair

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.protocol import encoder as encoder_module
from vllm_bridge.bridge.protocol.encoder import Encoder
from vllm_bridge.bridge.protocol.registry import TypeRegistry
from vllm_bridge.bridge.worker.server import Worker

F = "foreign_support"
MODULES = (*PUBLIC_MODULES, F)
HEADER = 4


def frame(msg: list[Any]) -> bytes:
    body = msgpack.packb(msg)
    return len(body).to_bytes(HEADER, "big") + body


def plan(monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, dict[int, Any]]:
    """The request frames, and what each reply must be: ``("refused", message start)``,
    ``("chunk then refused", message start)`` or ``("ok", reply bytes)``."""
    frames, expect = [], {}
    reference = Encoder(TypeRegistry(MODULES))
    rid = 100
    for n, code in enumerate(CODES):
        bad, good, path = pair(n, code, depth=n % 6)
        foreign_support.VALUES[2 * n], foreign_support.VALUES[2 * n + 1] = bad, good
        at = f" (at {path})" if path else ""
        what = f" is a msgpack.ExtType (code {code}, 9 bytes of data)"
        rid += 1
        frames.append(frame(["call", rid, None, None, ["m", F, "value"], [2 * n], {}]))
        expect[rid] = ("refused", f"the reply to call {rid}{at}{what}")
        rid += 1
        frames.append(frame(["call", rid, None, None, ["m", F, "value"], [2 * n + 1], {}]))
        with monkeypatch.context() as m:  # the encoder without the check
            m.setattr(encoder_module, "holds_foreign", lambda data, made, value: False)
            body = b"".join(bytes(s) for s in reference.encode(["ok", rid, good]))
        expect[rid] = ("ok", body)
        if n % 4 == 0:
            rid += 1
            frames.append(frame(["stream", rid, None, None, ["m", F, "values"], [2 * n], {}]))
            expect[rid] = ("chunk then refused", f"a chunk of stream {rid}{at}{what}")
            rid += 1
            frames.append(frame(["enter", rid, None, None, ["m", F, "Holder"], [2 * n], {}]))
            expect[rid] = ("refused", f"the reply to enter {rid} (at [1]{path}){what}")
    add = ["m", "vllm_bridge.bridge.diag", "add"]
    frames.append(frame(["call", 1, None, None, add, [1, 2], {}]))
    expect[1] = ("ok", msgpack.packb(["ok", 1, 3]))
    return b"".join(frames), expect


def run_worker(stream: Path, out: Path, lane: bool) -> tuple[Worker, int]:
    worker = Worker(MODULES, 8, lane=lane)
    taken = 0
    if worker.lane is not None:
        through = worker.lane._in_session

        def counted(req: Any, session: Any) -> Any:
            nonlocal taken
            taken += 1
            return through(req, session)

        worker.lane._in_session = counted  # type: ignore[method-assign]
    run_loop(worker, stream, out)
    return worker, taken


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "general"])
def test_a_result_holding_an_ext_type_is_refused_naming_where_and_the_worker_serves_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lane: bool
) -> None:
    data, expect = plan(monkeypatch)
    stream, out = tmp_path / "frames", tmp_path / "replies"
    stream.write_bytes(data)
    worker, taken = run_worker(stream, out, lane)
    if lane:
        assert taken > 2 * len(CODES)  # the calls of value() after the first: the lane's
    replies = split_frames(out.read_bytes())
    got: dict[int, list[Any]] = {}
    for body in replies:
        msg = msgpack.unpackb(body, strict_map_key=False)
        got.setdefault(msg[1], []).append((msg, body))
    assert set(got) == set(expect)
    for rid, (kind, want) in expect.items():
        msgs = got[rid]
        if kind == "ok":
            assert [b for _, b in msgs] == [want], rid
            continue
        if kind == "chunk then refused":
            assert msgs[0][0] == ["chunk", rid, "first"], rid
            msgs = msgs[1:]
        assert len(msgs) == 1, (rid, msgs)
        (msg, _), = msgs
        assert msg[0] == "error", (rid, msg)
        err = msg[2]
        assert (err["type"], err["python_type"]) == ("python_exception", "TypeError"), err
        assert err["message"].startswith(want), (err["message"], want)
        said = err["message"]
        assert "only the encoder makes those" in said or "not in the protocol's table" in said
    # No reference or entered context was left behind by a refused reply.
    session = worker.sessions.get(None)
    assert not session.refs and not session.contexts
