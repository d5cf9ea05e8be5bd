"""DP group setup in this process (a one-rank group), argument checks of the DP
coordination, and the decision rules on gathered matrices of more than two ranks.

Two-rank runs over real processes are in test_fc_dp_two_ranks.py.
"""

import pytest
import torch

from dp_env import clean_env, free_port  # noqa: F401 (clean_env: a fixture)
from vllm_bridge import dp
from vllm_bridge.dp._decide import NUM_ROWS, decide
from vllm_bridge.dp._devices import group_device, sync_device
from vllm_bridge.config import ParallelConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import coordinate_batch_across_dp


def test_one_rank_group_from_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    port = free_port()
    clean_env.setenv("VLLM_DP_RANK", "0")
    clean_env.setenv("VLLM_DP_SIZE", "1")
    clean_env.setenv("VLLM_DP_MASTER_PORT", str(port))
    clean_env.setenv("VLLM_DP_TIMEOUT_S", "5")
    # The default backend depends on the host (NCCL as well where CUDA is): name it.
    clean_env.setenv("VLLM_DP_BACKEND", "gloo")
    assert dp.dp_group_info() is None
    info = dp.init_dp_group()
    assert info == dp.DPGroupInfo(0, 1, "127.0.0.1", port, "gloo", 5.0, "cpu")
    assert dp.dp_group_info() == info
    # Joining again with the same settings is a no-op; different settings are refused.
    assert dp.init_dp_group() == info
    with pytest.raises(dp.DPGroupError, match="already in DP group"):
        dp.init_dp_group(master_port=port + 1)
    # A one-rank all_reduce returns the tensor unchanged.
    out = dp.dp_all_reduce(torch.tensor([3, 4], dtype=torch.int32), 1, 0)
    assert out.tolist() == [3, 4]
    with pytest.raises(dp.DPGroupError, match="DP rank 0 of 2 but .* joined as rank 0 of 1"):
        dp.dp_all_reduce(torch.zeros(2), 2, 0)
    assert dp.destroy_dp_group() is True
    assert dp.destroy_dp_group() is False
    assert dp.dp_group_info() is None


def test_arguments_win_over_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("VLLM_DP_SIZE", "7")
    clean_env.setenv("VLLM_DP_TIMEOUT_S", "9")
    info = dp.init_dp_group(rank=0, world_size=1, master_port=free_port(), timeout_s=3)
    assert (info.world_size, info.timeout_s) == (1, 3.0)


@pytest.mark.parametrize(
    "env, kwargs, exc, needle",
    [
        ({}, {"world_size": 1, "master_port": 1234}, ValueError, "rank is required"),
        ({}, {"rank": 0, "master_port": 1234}, ValueError, "VLLM_DP_SIZE"),
        ({}, {"rank": 0, "world_size": 1}, ValueError, "VLLM_DP_MASTER_PORT"),
        ({"VLLM_DP_RANK": "zero"}, {}, ValueError, "VLLM_DP_RANK must be an integer, got 'zero'"),
        ({}, {"rank": 2, "world_size": 2, "master_port": 1}, ValueError,
         "rank must be < world_size"),
        ({}, {"rank": 0, "world_size": 1, "master_port": 70000}, ValueError, "got 70000"),
        # (a wildcard from a call is refused earlier: test_dp_master_addr.py)
        ({"VLLM_DP_MASTER_IP": "0.0.0.0"}, {"rank": 0, "world_size": 1, "master_port": 1},
         ValueError, "master_addr must be the address of rank 0's host .* got '0.0.0.0'"),
        ({}, {"rank": 0, "world_size": 1, "master_port": 1, "master_addr": "0.0.0.0"},
         ValueError, "master_addr '0.0.0.0' is refused: .* dp: option"),
        ({"VLLM_DP_MASTER_IP": " 10.0.0.1"}, {"rank": 0, "world_size": 1, "master_port": 1},
         ValueError, "got ' 10.0.0.1'"),
        ({}, {"rank": 0, "world_size": 1, "master_port": 1, "timeout_s": 0}, ValueError,
         "timeout_s must be > 0, got 0"),
        ({"VLLM_DP_TIMEOUT_S": "soon"}, {"rank": 0, "world_size": 1, "master_port": 1},
         ValueError, "VLLM_DP_TIMEOUT_S must be a number, got 'soon'"),
        ({}, {"rank": 0, "world_size": 1, "master_port": 1, "backend": "mpi"}, ValueError,
         "got 'mpi'"),
    ],
)
def test_bad_settings_are_refused_by_name(
    clean_env: pytest.MonkeyPatch, env: dict, kwargs: dict, exc: type, needle: str
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(exc, match=needle):
        dp.init_dp_group(**kwargs)
    assert dp.dp_group_info() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only host")
def test_nccl_is_refused_without_cuda(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="needs CUDA"):
        dp.init_dp_group(0, 1, master_port=free_port(), backend="nccl")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA device")
def test_nccl_one_rank_group_reduces_on_the_device(clean_env: pytest.MonkeyPatch) -> None:
    info = dp.init_dp_group(0, 1, master_port=free_port(), backend="cpu:gloo,cuda:nccl")
    assert "nccl" in info.backend
    # Rank 0 takes GPU 0, and that is this process's current device from now on.
    assert info.device == "cuda:0" and torch.cuda.current_device() == 0
    cfg = ParallelConfig()
    assert sync_device(info, cfg, dp.DPGroupError) == torch.device("cuda:0")
    out = dp.dp_all_reduce(torch.tensor([5, 6], device="cuda"), 1, 0)
    assert out.device.type == "cuda" and out.tolist() == [5, 6]
    cpu_cfg = ParallelConfig(disable_nccl_for_dp_synchronization=True)
    assert sync_device(info, cpu_cfg, dp.DPGroupError).type == "cpu"
    assert dp.dp_all_reduce(torch.tensor([7]), 1, 0).tolist() == [7]


def test_a_group_without_nccl_runs_its_collectives_on_the_cpu(clean_env) -> None:
    info = dp.init_dp_group(0, 1, master_port=free_port(), backend="gloo")
    assert info.device == "cpu"
    assert sync_device(info, ParallelConfig(), dp.DPGroupError) == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_ranks_take_turns_over_the_gpus() -> None:
    n = torch.cuda.device_count()
    assert [group_device(r, "nccl") for r in range(n + 1)] == [
        f"cuda:{i}" for i in [*range(n), 0]
    ]
    assert group_device(3, "gloo") == "cpu"


def test_dp_off_needs_no_group_and_returns_the_mode() -> None:
    assert dp.dp_group_info() is None
    result = coordinate_batch_across_dp(5, False, True, ParallelConfig(), cudagraph_mode=2)
    assert result == (False, None, 2)
    result = coordinate_batch_across_dp(5, False, False, ParallelConfig(),
                                        cudagraph_mode=CUDAGraphMode.PIECEWISE)
    assert result == (False, None, 1)


def test_dp_on_without_a_group_says_how_to_join() -> None:
    cfg = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    with pytest.raises(dp.DPGroupError, match=r"init_dp_group\(\.\.\.\) on every rank"):
        coordinate_batch_across_dp(5, False, False, cfg)


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        ({"num_tokens_unpadded": -1}, ValueError, "num_tokens_unpadded must be >= 0, got -1"),
        ({"allow_microbatching": "no"}, TypeError, "allow_microbatching must be a bool"),
        ({"parallel_config": {}}, TypeError, "parallel_config must be a ParallelConfig"),
        ({"num_tokens_padded": 3}, ValueError, "num_tokens_padded must be >= 4, got 3"),
        ({"allow_microbatching": True}, ValueError, "uniform_decode must be given"),
        ({"cudagraph_mode": 3}, ValueError, "got 3"),
        ({"cudagraph_mode": CUDAGraphMode.FULL_AND_PIECEWISE}, ValueError,
         "got FULL_AND_PIECEWISE"),
        ({"num_scheduled_tokens_per_request": [1, 2]}, ValueError, "sums to 3, but .* is 4"),
        ({"num_scheduled_tokens_per_request": "12"}, TypeError, "must be a list of ints"),
    ],
)
def test_coordinate_argument_errors(kwargs: dict, exc: type, needle: str) -> None:
    args = {
        "num_tokens_unpadded": 4,
        "allow_microbatching": False,
        "allow_dp_padding": False,
        "parallel_config": ParallelConfig(data_parallel_size=2),
    } | kwargs
    with pytest.raises(exc, match=needle):
        coordinate_batch_across_dp(**args)


def _matrix(columns: list[tuple[int, int, int, int, int]]) -> torch.Tensor:
    """Columns of (unpadded, padded, ubatch vote, cudagraph mode, padding vote)."""
    table = torch.zeros(NUM_ROWS, len(columns), dtype=torch.int32)
    for rank, column in enumerate(columns):
        table[:, rank] = torch.tensor(column, dtype=torch.int32)
    return table


def test_decision_over_three_ranks() -> None:
    should, counts, mode = decide(_matrix([(9, 10, 1, 2, 1), (6, 6, 1, 1, 1), (8, 8, 1, 2, 1)]), 2)
    assert (should, counts.tolist(), mode) == (True, [10, 10, 10], 1)
    # One rank votes no: nobody micro-batches, padding still applies as asked.
    should, counts, _ = decide(_matrix([(9, 10, 1, 2, 1), (6, 6, 0, 2, 1), (8, 8, 1, 2, 1)]), 2)
    assert (should, counts.tolist()) == (False, [10, 10, 10])
    # Three micro-batches of a 12-token padded batch: a rank with 8 real tokens fills the
    # first two (4 + 4) and leaves the third empty.
    should, _, _ = decide(_matrix([(12, 12, 1, 0, 0), (8, 8, 1, 0, 0), (9, 9, 1, 0, 0)]), 3)
    assert should is False
    should, counts, _ = decide(_matrix([(12, 12, 1, 0, 0), (9, 9, 1, 0, 0), (10, 10, 1, 0, 0)]), 3)
    assert (should, counts.tolist()) == (True, [12, 12, 12])
