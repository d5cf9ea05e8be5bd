"""What the encoder's refusal of extension values it did not make costs
(python/vllm_bridge/bridge/protocol/foreign.py): Encoder.encode of replies; and what the
refusal of msgpack's timestamp costs: the search for its header's bytes
(types.timestamp_header_in), in Decoder.decode of requests, and the walk that follows a
header found (types.find_raw_ext), in microseconds per call (the best of 7 rounds,
thread CPU time). Run it from two trees in turn to compare
them, each tree's ``python/`` first on the path::

    PYTHONPATH=<tree>/python .venv/bin/python bench/codec_checks/encode_ext.py
"""

from __future__ import annotations

import random
import time

import msgpack
import torch

from vllm_bridge.bridge.protocol import Atom, Decoder, Encoder, packb, registry_for
from vllm_bridge.bridge.protocol import types as wire_types

rng = random.Random(1)
REPLIES = {
    "['ok', id, [1, 2, 3]]": [1, 2, 3],
    "['ok', id, {'a': 'x', 'b': None}]": {"a": "x", "b": None},
    "list of 1000 ints": list(range(1000)),
    "list of 1000 floats": [rng.random() for _ in range(1000)],
    "dict of 100 str->float": {f"k{i}": rng.random() for i in range(100)},
    "nested": {
        "rows": [[i, float(i) / 3, str(i)] for i in range(50)],
        "meta": {"x": {"y": [1, 2, {"z": "w"}]}, "t": (1, "a", Atom("ok"))},
        "flags": [None, True, 1.5] * 20,
    },
    "100 atoms": [Atom(f"a{i % 7}") for i in range(100)],
    "tensor 4 floats": torch.ones(4),
    "tensor 16 KiB (inline)": torch.randn(64, 64),
    "tensor 1 MiB (spliced)": torch.randn(512, 512),
    "[tensor 16 KiB] * 8": [torch.randn(64, 64) for _ in range(8)],
    "bytes 1 MiB": rng.randbytes(1 << 20),
    "str 1 MiB (ASCII)": "x" * (1 << 20),
}


def best(fn, number: int, rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(number):
            fn()
        times.append((time.thread_time() - start) / number * 1e6)
    return min(times)


def main() -> None:
    encoder = Encoder(registry_for())
    for name, value in REPLIES.items():
        msg = ["ok", 12345, value]
        size = sum(len(s) if isinstance(s, bytes) else s.nbytes for s in encoder.encode(msg))
        number = max(20, min(20_000, 2_000_000 // max(size, 100)))
        us = best(lambda: encoder.encode(msg), number)
        print(f"encode {name:32s} {size:>8d} B  {us:10.2f} us")
    decoder = Decoder()
    for name, args in {
        "add(1, -1)": [1, -1],
        "echo(1000 floats)": [[rng.random() for _ in range(1000)]],
        "echo(1000 x -1)": [[-1] * 1000],
    }.items():
        body = packb(["call", 7, None, None, ["m", "vllm_bridge.bridge.diag", "echo"], args, {}])
        us = best(lambda: decoder.decode(body), 2000)
        print(f"decode {name:32s} {len(body):>8d} B  {us:10.2f} us")
    # The timestamp walk (the decoder's, on a body whose bytes hold a timestamp's header).
    find = getattr(wire_types, "find_raw_ext", None) or wire_types.find_timestamp
    for name, value in {
        "a million floats": [rng.random() for _ in range(1_000_000)],
        "1000 x [3 ints]": [[i, i + 1, i + 2] for i in range(1000)],
        "dict of 10000 str->int": {f"k{i}": i for i in range(10_000)},
    }.items():
        us = best(lambda: find(value), 3 if len(value) > 10_000 else 200)
        print(f"walk   {name:32s} {'':>10s}  {us:10.2f} us")
    assert find([1, msgpack.Timestamp(1, 0)]) is not None


if __name__ == "__main__":
    main()
