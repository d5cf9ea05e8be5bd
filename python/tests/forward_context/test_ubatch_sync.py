"""How the DP ranks end a micro-batched run (vllm_bridge.dp._ubatch_sync), on a real
in-memory store: the drain's comparison of the ranks' collectives, where partners go, and
which store keys each rank deletes."""

import json

import pytest
import torch
import torch.distributed as dist

from vllm_bridge.dp import DPGroupInfo
from vllm_bridge.dp._ubatch_sync import (
    UBatchRunSync,
    _key,
    check_one_sequence,
    describe,
    drain,
    partner_device,
)


def _info(rank: int = 0, device: str = "cuda:0") -> DPGroupInfo:
    return DPGroupInfo(rank, 2, "127.0.0.1", 1, "cpu:gloo,cuda:nccl", 2.0, device=device)


def test_ranks_on_different_gpus_post_the_same_sequence() -> None:
    # With NCCL each rank uses its own GPU: rank 0's ops on cuda:0, rank 1's on cuda:1.
    mine = [["all_gather", [4, 8], "torch.float32", "cuda:0"]]
    theirs = [["all_gather", [4, 8], "torch.float32", "cuda:1"],
              ["all_reduce", [4, 8], "torch.float32", "cuda:1"]]
    longest = check_one_sequence(3, [mine, theirs])
    assert [op[0] for op in longest] == ["all_gather", "all_reduce"]
    # The device type still counts: a CPU op is not a CUDA op.
    with pytest.raises(RuntimeError, match="DP rank 1's collectives of micro-batched run 3"):
        check_one_sequence(3, [mine, [["all_gather", [4, 8], "torch.float32", "cpu"]]])
    with pytest.raises(RuntimeError, match="DP rank 0's collectives"):
        check_one_sequence(3, [[["all_reduce", [4, 8], "torch.float32", "cuda:0"]], theirs])


def test_drain_accepts_the_same_ops_on_each_ranks_own_gpu() -> None:
    store = dist.HashStore()
    store.set(_key(5, "posted/1"), json.dumps([["all_gather", [2], "torch.float32", "cuda:1"]]))
    # Same sequence, another GPU, nothing beyond this rank's own: no partner, no error.
    drain(store, _info(), 5, [("all_gather", [2], "torch.float32", "cuda:0")], [])


def test_a_partner_goes_on_this_ranks_own_device() -> None:
    assert partner_device("cuda", _info(device="cuda:1")) == torch.device("cuda:1")
    assert partner_device("cpu", _info(device="cuda:1")) == torch.device("cpu")
    assert describe("all_reduce", torch.zeros(3, 2)) == (
        "all_reduce", [3, 2], "torch.float32", "cpu"
    )


class _State:
    def __init__(self, rank: int, store: dist.Store) -> None:
        self.info = DPGroupInfo(rank, 2, "127.0.0.1", 1, "gloo", 2.0)
        self.store = store
        self.broken = None
        self.ubatch_last_failed = False


def test_each_rank_deletes_only_its_own_keys_of_the_previous_run() -> None:
    import threading

    store = dist.HashStore()
    lock = threading.Lock()
    states = [_State(0, store), _State(1, store)]

    def finish_both(run: int) -> None:
        # Rank 1's outcome first, so rank 0's exchange completes; then rank 1's.
        store.set(_key(run, "done/1"), "ok")
        assert UBatchRunSync(states[0], lock, run).finish(None, [], []) is None
        assert UBatchRunSync(states[1], lock, run).finish(None, [], []) is None

    finish_both(0)
    store.set(_key(0, "abort"), "left over")  # as if run 0 had been aborted
    states[0].ubatch_last_failed = states[1].ubatch_last_failed = True
    store.set(_key(0, "posted/0"), "[]")
    store.set(_key(0, "posted/1"), "[]")
    finish_both(1)
    # Run 0's keys are gone (each rank deleted its own, and the abort key); run 1's stay
    # until run 2 ends.
    assert not store.check([_key(0, "done/0")]) and not store.check([_key(0, "done/1")])
    assert not store.check([_key(0, "posted/0")]) and not store.check([_key(0, "posted/1")])
    assert not store.check([_key(0, "abort")])
    assert store.check([_key(1, "done/0")]) and store.check([_key(1, "done/1")])
    assert store.num_keys() == 2
