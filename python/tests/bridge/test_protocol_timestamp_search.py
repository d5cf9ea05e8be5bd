"""Where msgpack's timestamp (ext -1) may sit is found by its header's bytes
(types.timestamp_header_in): the bytes 0xFF are found in C and the bytes before each
compared, from Python for the first few, by substring searches or numpy past them. It
finds exactly what a search for each of the eleven headers finds, in bytes, bytearrays and
memoryviews, across numpy's chunks; and the walk that follows it (types.find_raw_ext)
finds a Timestamp or an ExtType wherever one sits, also among many plain scalars."""

from __future__ import annotations

import random

import msgpack
import pytest

from vllm_bridge.bridge.protocol import types

HEADERS = types._TIMESTAMP_HEADERS


def searched(data: bytes) -> bool:
    """The plain answer: a substring search for each header."""
    return any(h in data for h in HEADERS)


def forms(data: bytes) -> list[bytes | bytearray | memoryview]:
    return [data, bytearray(data), memoryview(data), memoryview(bytearray(data))]


def test_it_finds_what_eleven_substring_searches_find() -> None:
    rng = random.Random(11)
    # Mostly the bytes headers are made of, so that near-headers are common.
    alphabet = [0xFF, 0xD6, 0xD7, 0xC7, 0xC8, 0xC9, 0, 4, 8, 12, 0x80]
    found = 0
    for _ in range(6000):
        size = rng.choice([1, 2, 3, 5, 6, 9, 40, 300, 5000, 20_000])
        data = bytes(
            rng.choice(alphabet) if rng.random() < 0.85 else rng.randrange(256)
            for _ in range(size)
        )
        want = searched(data)
        found += want
        for form in forms(data):
            assert types.timestamp_header_in(form) == want, (data[:80].hex(), type(form))
    assert 500 < found < 5500  # both answers, often


@pytest.mark.parametrize("header", HEADERS)
def test_a_header_is_found_wherever_it_sits_in_a_large_body(header: bytes) -> None:
    # Random bytes with no header, over numpy's first chunks (64 KiB, 128 KiB, ... 1 MiB)
    # and into a second MiB, a header put across each boundary and at both ends.
    rng = random.Random(len(header))
    body = bytearray(rng.randbytes(3 << 20))
    while searched(bytes(body)):
        for h in HEADERS:
            body = body.replace(h, bytes(len(h)))
    assert body.count(0xFF) > 1000
    for form in forms(bytes(body)):
        assert not types.timestamp_header_in(form)
    edges = [1 << 16, 3 << 16, 7 << 16, 15 << 16, 1 << 20, (1 << 20) + (31 << 16), 2 << 20]
    for at in [0, *(e - k for e in edges for k in range(len(header))), len(body) - len(header)]:
        placed = bytes(body[:at] + header + body[at + len(header) :])
        for form in forms(placed):
            assert types.timestamp_header_in(form), (at, type(form))


def test_the_walk_finds_one_among_many_plain_scalars_and_in_every_container() -> None:
    ts, ext = msgpack.Timestamp(1, 0), msgpack.ExtType(6, b"x")
    plain = [1.5] * 1000
    for found in (ts, ext):
        for value in (
            plain + [found],
            [found] + plain,
            {f"k{i}": 1.0 for i in range(100)} | {"z": found},
            {**{i: "v" for i in range(100)}, found: 1},
            tuple(plain[:500]) + ([[found]],),
        ):
            assert types.find_raw_ext(value) is found
    assert types.find_raw_ext([plain, {"a": plain}, (plain,)]) is None
