"""ParallelConfig, CompilationConfig, VllmConfig: defaults and validation at construction."""

import pytest

from vllm_bridge.config import CompilationConfig, ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode


def test_default_construction_is_one_rank_without_graphs() -> None:
    cfg = VllmConfig()
    assert cfg.parallel_config.data_parallel_size == 1
    assert cfg.parallel_config.data_parallel_rank == 0
    assert cfg.parallel_config.is_moe_model is None
    assert cfg.parallel_config.enable_dbo is False
    assert cfg.parallel_config.num_ubatches == 2
    assert cfg.compilation_config.cudagraph_mode is CUDAGraphMode.NONE
    assert cfg.compilation_config.cudagraph_capture_sizes == []
    assert cfg.compilation_config.max_cudagraph_capture_size is None
    assert cfg.compilation_config.static_forward_context == {}


def test_defaults_are_not_shared_between_instances() -> None:
    a, b = VllmConfig(), VllmConfig()
    a.compilation_config.static_forward_context["layer"] = object()
    assert b.compilation_config.static_forward_context == {}


def test_capture_sizes_sorted_deduplicated_and_max_derived() -> None:
    cfg = CompilationConfig(cudagraph_capture_sizes=[8, 1, 4, 8, 2])
    assert cfg.cudagraph_capture_sizes == [1, 2, 4, 8]
    assert cfg.max_cudagraph_capture_size == 8
    assert CompilationConfig(cudagraph_capture_sizes=[]).max_cudagraph_capture_size is None


def test_cudagraph_mode_accepts_member_names() -> None:
    cfg = CompilationConfig(cudagraph_mode="full_and_piecewise")  # type: ignore[arg-type]
    assert cfg.cudagraph_mode is CUDAGraphMode.FULL_AND_PIECEWISE


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        ({"data_parallel_size": 0}, ValueError, "data_parallel_size must be >= 1, got 0"),
        ({"data_parallel_size": 2, "data_parallel_rank": 2}, ValueError, "got 2"),
        ({"data_parallel_rank": -1}, ValueError, "data_parallel_rank must be >= 0, got -1"),
        ({"data_parallel_size": "2"}, TypeError, "data_parallel_size must be an int"),
        ({"is_moe_model": "yes"}, TypeError, "is_moe_model must be a bool"),
        ({"enable_dbo": 1}, TypeError, "enable_dbo must be a bool, got 1"),
        ({"dbo_decode_token_threshold": 0}, ValueError, "dbo_decode_token_threshold"),
        ({"num_ubatches": 1}, ValueError, "num_ubatches must be >= 2, got 1"),
    ],
)
def test_parallel_config_refuses_bad_values(kwargs: dict, exc: type, needle: str) -> None:
    with pytest.raises(exc, match=needle):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        ({"cudagraph_mode": "warp"}, ValueError, "cudagraph_mode: unknown .* name 'warp'"),
        ({"cudagraph_capture_sizes": [4, 0]}, ValueError, "cudagraph_capture_sizes entry"),
        ({"cudagraph_capture_sizes": 8}, TypeError, "cudagraph_capture_sizes must be a list"),
        (
            {"cudagraph_capture_sizes": [4, 16], "max_cudagraph_capture_size": 8},
            ValueError,
            r"max_cudagraph_capture_size \(8\) is below .* \(16\)",
        ),
        ({"static_forward_context": []}, TypeError, "static_forward_context must be a dict"),
        ({"static_all_moe_layers": ["a", 1]}, TypeError, "static_all_moe_layers"),
    ],
)
def test_compilation_config_refuses_bad_values(kwargs: dict, exc: type, needle: str) -> None:
    with pytest.raises(exc, match=needle):
        CompilationConfig(**kwargs)


def test_vllm_config_checks_member_types() -> None:
    with pytest.raises(TypeError, match="parallel_config must be a ParallelConfig"):
        VllmConfig(parallel_config={"data_parallel_size": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="compilation_config must be a CompilationConfig"):
        VllmConfig(compilation_config=None)  # type: ignore[arg-type]
