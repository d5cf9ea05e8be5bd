"""Real 2-process DP runs over a gloo group: coordinate_batch_across_dp and
set_forward_context with DP metadata, a missing peer at init and at the all_reduce.

Two spawned processes (DP ranks 0 and 1) live for the whole module, each taking commands
over a pipe, so torch is imported once per rank. Every command runs in a fresh thread
inside a fresh ``contextvars.Context``, as a bridge session's call would.
"""

import contextvars
import multiprocessing as mp
import socket
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from dp_env import free_port
from vllm_bridge.config import ParallelConfig, VllmConfig

#: Seconds a rank waits for its peers in these tests (kept short for the missing-peer cases).
PEER_TIMEOUT_S = 2.0
#: Guard against a hung rank: a reply must come within this (not a performance check).
REPLY_GUARD_S = 60.0


# ---------------------------------------------------------------- code run in the ranks


def _cmd_init(rank: int, world_size: int, port: int, timeout_s: float) -> Any:
    from vllm_bridge import dp

    return dp.init_dp_group(rank, world_size, "127.0.0.1", port, "gloo", timeout_s)


def _cmd_destroy() -> bool:
    from vllm_bridge import dp

    return dp.destroy_dp_group()


def _cmd_coordinate(config: dict, **kwargs: Any) -> Any:
    from vllm_bridge.forward_context import coordinate_batch_across_dp

    return coordinate_batch_across_dp(parallel_config=ParallelConfig(**config), **kwargs)


def _cmd_forward(config: dict, num_tokens: int) -> dict:
    """Enter set_forward_context without counts (so it coordinates) and report the context."""
    from vllm_bridge import forward_context as fc

    vllm_config = VllmConfig(parallel_config=ParallelConfig(**config))
    with fc.set_forward_context(None, vllm_config, num_tokens=num_tokens):
        meta = fc.get_forward_context().dp_metadata
        with meta.chunked_sizes(1, 4, 1) as chunk:
            chunk = list(chunk)
        out = {
            "across": meta.num_tokens_across_dp_cpu.tolist(),
            "max": int(meta.max_tokens_across_dp_cpu),
            "chunk1": chunk,
        }
    out["set_after_exit"] = fc.is_forward_context_available()
    return out


def _cmd_coordinate_then_forward(config: dict, num_tokens: int) -> dict:
    """The overview's DP example: agree on padded counts, then run the pass with them."""
    from vllm_bridge import forward_context as fc

    parallel_config = ParallelConfig(**config)
    _, across, _ = fc.coordinate_batch_across_dp(num_tokens, False, True, parallel_config)
    padded = int(across[parallel_config.data_parallel_rank])
    vllm_config = VllmConfig(parallel_config=parallel_config)
    with fc.set_forward_context({"layer": "meta"}, vllm_config, num_tokens=padded,
                                num_tokens_across_dp=across):
        meta = fc.get_forward_context().dp_metadata
        return {"padded": padded, "across": meta.num_tokens_across_dp_cpu.tolist()}


def _cmd_collectives(rank: int, device: str) -> tuple:
    """dp_all_reduce and dp_all_gather of a tensor on ``device``: whether the sum landed in
    place, and where and what each result is."""
    from vllm_bridge import dp

    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], device=device)
    out = dp.dp_all_reduce(t, 2, rank)
    gathered = dp.dp_all_gather(torch.tensor([rank + 5.0], device=device), 2, rank)
    return (out is t, t.device.type, t.tolist(), gathered.device.type, gathered.tolist())


def _run_in_fresh_context(fn: Any, kwargs: dict) -> tuple:
    box: list[tuple] = []

    def body() -> None:
        try:
            box.append(("ok", fn(**kwargs)))
        except Exception as exc:  # reported to the test, which asserts on it
            box.append(("error", type(exc).__name__, str(exc)))

    thread = threading.Thread(target=contextvars.Context().run, args=(body,))
    thread.start()
    thread.join()
    return box[0]


def _rank_main(conn: Connection) -> None:
    commands = {
        "init": _cmd_init,
        "destroy": _cmd_destroy,
        "coordinate": _cmd_coordinate,
        "forward": _cmd_forward,
        "coordinate_then_forward": _cmd_coordinate_then_forward,
        "collectives": _cmd_collectives,
    }
    while True:
        msg = conn.recv()
        if msg is None:
            _cmd_destroy()
            return
        name, kwargs = msg
        conn.send(_run_in_fresh_context(commands[name], kwargs))


# ---------------------------------------------------------------- the test side


class Ranks:
    """Two rank processes; ``both`` sends one command to each and gathers the replies."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(child,), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def send(self, to: int, name: str, **kwargs: Any) -> None:
        self.conns[to].send((name, kwargs))

    def recv(self, frm: int) -> tuple:
        if not self.conns[frm].poll(REPLY_GUARD_S):
            raise AssertionError(f"rank {frm} gave no reply within {REPLY_GUARD_S} s")
        return self.conns[frm].recv()

    def both(self, name: str, per_rank: list[dict]) -> list[tuple]:
        for rank, kwargs in enumerate(per_rank):
            self.send(rank, name, **kwargs)
        return [self.recv(rank) for rank in range(2)]

    def join_group(self) -> None:
        port = free_port()
        replies = self.both(
            "init",
            [dict(rank=r, world_size=2, port=port, timeout_s=PEER_TIMEOUT_S) for r in range(2)],
        )
        assert [r[0] for r in replies] == ["ok", "ok"], replies

    def leave_group(self) -> None:
        self.both("destroy", [{}, {}])

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    pool = Ranks()
    try:
        pool.join_group()
        yield pool
    finally:
        pool.close()


def _cfg(rank: int, **extra: Any) -> dict:
    return {"data_parallel_size": 2, "data_parallel_rank": rank, **extra}


def _ok(reply: tuple) -> Any:
    assert reply[0] == "ok", reply
    return reply[1]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
    ],
)
def test_the_collectives_sum_in_place_and_gather_by_rank(ranks: Ranks, device: str) -> None:
    # On this gloo group a CUDA tensor goes through the CPU; the sum still lands in it.
    replies = ranks.both("collectives", [dict(rank=0, device=device), dict(rank=1, device=device)])
    for reply in replies:
        assert _ok(reply) == (True, device, [3.0, 30.0], device, [[5.0], [6.0]])


def test_uneven_counts_without_padding_are_gathered(ranks: Ranks) -> None:
    replies = ranks.both(
        "coordinate",
        [
            dict(config=_cfg(0), num_tokens_unpadded=7, allow_microbatching=False,
                 allow_dp_padding=False),
            dict(config=_cfg(1), num_tokens_unpadded=3, allow_microbatching=False,
                 allow_dp_padding=False),
        ],
    )
    for reply in replies:
        should_ubatch, across, mode = _ok(reply)
        assert should_ubatch is False
        assert across.tolist() == [7, 3]
        assert across.device.type == "cpu"
        assert mode == 0


def test_padding_brings_every_rank_to_the_maximum(ranks: Ranks) -> None:
    replies = ranks.both(
        "coordinate",
        [
            dict(config=_cfg(0), num_tokens_unpadded=7, allow_microbatching=False,
                 allow_dp_padding=True, num_tokens_padded=8),
            dict(config=_cfg(1), num_tokens_unpadded=3, allow_microbatching=False,
                 allow_dp_padding=True),
        ],
    )
    assert [_ok(r)[1].tolist() for r in replies] == [[8, 8], [8, 8]]


def test_cudagraph_mode_is_synced_to_the_minimum(ranks: Ranks) -> None:
    replies = ranks.both(
        "coordinate",
        [
            dict(config=_cfg(0), num_tokens_unpadded=4, allow_microbatching=False,
                 allow_dp_padding=False, cudagraph_mode=2),
            dict(config=_cfg(1), num_tokens_unpadded=4, allow_microbatching=False,
                 allow_dp_padding=False, cudagraph_mode=1),
        ],
    )
    assert [_ok(r)[2] for r in replies] == [1, 1]


DBO = {"enable_dbo": True, "dbo_prefill_token_threshold": 8, "dbo_decode_token_threshold": 2}


def _vote(tokens: tuple[int, int], padded: tuple[int, int] | None = None) -> list[dict]:
    return [
        dict(config=_cfg(r, **DBO), num_tokens_unpadded=tokens[r], allow_microbatching=True,
             allow_dp_padding=False, uniform_decode=False,
             num_tokens_padded=None if padded is None else padded[r])
        for r in range(2)
    ]


def test_micro_batching_when_every_rank_votes_for_it(ranks: Ranks) -> None:
    replies = ranks.both("coordinate", _vote((16, 12)))
    for reply in replies:
        should_ubatch, across, _ = _ok(reply)
        assert should_ubatch is True
        assert across.tolist() == [16, 16]  # micro-batching forces padding


def test_no_micro_batching_when_one_rank_is_under_its_threshold(ranks: Ranks) -> None:
    replies = ranks.both("coordinate", _vote((16, 5)))
    for reply in replies:
        should_ubatch, across, _ = _ok(reply)
        assert should_ubatch is False
        assert across.tolist() == [16, 5]


def test_no_micro_batching_when_a_micro_batch_would_be_empty(ranks: Ranks) -> None:
    # Rank 1 has 10 real tokens; padded to rank 0's 20, its second half is padding only.
    replies = ranks.both("coordinate", _vote((20, 10)))
    assert [_ok(r)[0] for r in replies] == [False, False]
    replies = ranks.both("coordinate", _vote((20, 11)))
    assert [_ok(r)[0] for r in replies] == [True, True]


def test_ranks_disagreeing_on_padding_both_get_a_clear_error(ranks: Ranks) -> None:
    replies = ranks.both(
        "coordinate",
        [
            dict(config=_cfg(0), num_tokens_unpadded=4, allow_microbatching=False,
                 allow_dp_padding=True),
            dict(config=_cfg(1), num_tokens_unpadded=4, allow_microbatching=False,
                 allow_dp_padding=False),
        ],
    )
    for reply in replies:
        assert reply[0] == "error" and reply[1] == "ValueError", reply
        assert "disagree on allow_dp_padding" in reply[2]


def test_a_config_that_does_not_match_the_group_is_refused_locally(ranks: Ranks) -> None:
    ranks.send(0, "coordinate", config=_cfg(1), num_tokens_unpadded=4,
               allow_microbatching=False, allow_dp_padding=False)
    reply = ranks.recv(0)
    assert reply[:2] == ("error", "DPGroupError")
    assert "DP rank 1 of 2" in reply[2] and "joined as rank 0 of 2" in reply[2]


def test_set_forward_context_coordinates_dp_metadata(ranks: Ranks) -> None:
    replies = ranks.both(
        "forward",
        [dict(config=_cfg(0), num_tokens=9), dict(config=_cfg(1), num_tokens=2)],
    )
    for reply in replies:
        out = _ok(reply)
        assert out["across"] == [9, 2]
        assert out["max"] == 9
        # chunk 1 of 4-token chunks: rank 0 has 9 - 4 = 5 left (capped at 4); rank 1 ran
        # out but stays in lockstep with 1.
        assert out["chunk1"] == [4, 1]
        assert out["set_after_exit"] is False


def test_padded_counts_from_coordination_feed_set_forward_context(ranks: Ranks) -> None:
    replies = ranks.both(
        "coordinate_then_forward",
        [dict(config=_cfg(0), num_tokens=5), dict(config=_cfg(1), num_tokens=12)],
    )
    assert [_ok(r) for r in replies] == [{"padded": 12, "across": [12, 12]}] * 2


def test_missing_peer_at_the_all_reduce_fails_then_group_can_be_rejoined(
    ranks: Ranks,
) -> None:
    ranks.send(0, "coordinate", config=_cfg(0), num_tokens_unpadded=4,
               allow_microbatching=False, allow_dp_padding=False)
    reply = ranks.recv(0)
    assert reply[:2] == ("error", "DPTimeoutError"), reply
    assert "all_reduce did not complete within 2.0 s" in reply[2]
    # The group is now unusable on rank 0 and says so at once.
    ranks.send(0, "coordinate", config=_cfg(0), num_tokens_unpadded=4,
               allow_microbatching=False, allow_dp_padding=False)
    reply = ranks.recv(0)
    assert reply[:2] == ("error", "DPGroupError") and "destroy_dp_group()" in reply[2]
    # Tear down on both ranks, join a fresh group, and coordinate again.
    ranks.leave_group()
    ranks.join_group()
    replies = ranks.both(
        "coordinate",
        [dict(config=_cfg(r), num_tokens_unpadded=1 + r, allow_microbatching=False,
              allow_dp_padding=False) for r in range(2)],
    )
    assert [_ok(r)[1].tolist() for r in replies] == [[1, 2], [1, 2]]


def test_missing_peer_at_init_fails_on_both_sides(ranks: Ranks) -> None:
    ranks.leave_group()
    try:
        # Each rank waits for a group whose other member never comes: rank 0 hosts a
        # store nobody joins, rank 1 looks for a rank 0 that is not there.
        replies = ranks.both(
            "init",
            [dict(rank=r, world_size=2, port=free_port(), timeout_s=PEER_TIMEOUT_S)
             for r in range(2)],
        )
        for rank, reply in enumerate(replies):
            assert reply[:2] == ("error", "DPTimeoutError"), reply
            assert f"DP rank {rank}" in reply[2]
    finally:
        ranks.join_group()


def test_a_listener_that_never_answers_is_not_waited_on_forever(ranks: Ranks) -> None:
    # Something accepts connections on the port but is no rendezvous store (a frozen
    # rank 0 looks the same): rank 1 must still give up at its timeout.
    ranks.leave_group()
    silent = socket.socket()
    try:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        ranks.send(1, "init", rank=1, world_size=2, port=port, timeout_s=PEER_TIMEOUT_S)
        reply = ranks.recv(1)
        assert reply[:2] == ("error", "DPTimeoutError"), reply
        assert "did not answer as a rendezvous store" in reply[2]
    finally:
        silent.close()
        ranks.join_group()
