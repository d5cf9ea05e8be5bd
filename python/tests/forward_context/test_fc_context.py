"""ForwardContext and its lifecycle: create / set / override / get, isolation between
threads and contextvars.Contexts, the default batch descriptor and DP metadata."""

import contextvars
import dataclasses
import threading

import pytest
import torch

from vllm_bridge import forward_context as fc
from vllm_bridge.config import CompilationConfig, ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.dp import DPGroupError
from vllm_bridge.forward_context import (
    BatchDescriptor,
    ForwardContext,
    create_forward_context,
    get_forward_context,
    is_forward_context_available,
    override_forward_context,
    set_forward_context,
)
from vllm_bridge.ubatch import UBatchSlice

DP2_RANK0 = VllmConfig(parallel_config=ParallelConfig(data_parallel_size=2))


def test_forward_context_fields_in_seed_order() -> None:
    names = [f.name for f in dataclasses.fields(ForwardContext)]
    assert names == [
        "no_compile_layers", "attn_metadata", "slot_mapping", "virtual_engine", "dp_metadata",
        "cudagraph_runtime_mode", "batch_descriptor", "ubatch_slices", "skip_compiled",
        "all_moe_layers", "moe_layer_index", "additional_kwargs",
    ]
    assert ForwardContext.__module__ == "vllm_bridge.forward_context"


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY])
def test_two_routine_modes_are_not_runtime_modes(mode: CUDAGraphMode) -> None:
    with pytest.raises(ValueError, match=f"Invalid cudagraph runtime mode: {mode.name}"):
        ForwardContext({}, None, {}, 0, cudagraph_runtime_mode=mode)


def test_runtime_mode_given_by_name_is_converted() -> None:
    mode = "piecewise"  # as an Elixir atom arrives
    ctx = ForwardContext({}, None, {}, 0, cudagraph_runtime_mode=mode)  # type: ignore[arg-type]
    assert ctx.cudagraph_runtime_mode is CUDAGraphMode.PIECEWISE


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        ({"virtual_engine": -1}, ValueError, "virtual_engine must be >= 0, got -1"),
        ({"batch_descriptor": (8,)}, TypeError, "batch_descriptor must be a BatchDescriptor"),
        ({"ubatch_slices": [slice(0, 2)]}, TypeError, "ubatch_slices must be a list of UBatch"),
        ({"dp_metadata": {}}, TypeError, "dp_metadata must be a DPMetadata"),
        ({"skip_compiled": None}, TypeError, "skip_compiled must be a bool, got None"),
        ({"additional_kwargs": [1]}, TypeError, "additional_kwargs must be a dict, got \\[1\\]"),
        ({"slot_mapping": 5}, TypeError, "slot_mapping must be a dict .* or a list of them, .*got 5"),
        ({"slot_mapping": [{}, 5]}, TypeError, "slot_mapping must be a dict"),
    ],
)
def test_create_refuses_bad_fields(kwargs: dict, exc: type, needle: str) -> None:
    with pytest.raises(exc, match=needle):
        create_forward_context(None, VllmConfig(), **kwargs)


def test_forward_context_refuses_a_bad_layer_list_and_takes_lists_of_slot_maps() -> None:
    with pytest.raises(TypeError, match="all_moe_layers must be a list of str, got 5"):
        ForwardContext({}, None, {}, 0, all_moe_layers=5)
    with pytest.raises(TypeError, match="all_moe_layers must be a list of str"):
        ForwardContext({}, None, {}, 0, all_moe_layers=["moe.0", 1])
    ctx = ForwardContext({}, None, [{}, {}], 0, all_moe_layers=["moe.0", "moe.1"])
    assert ctx.slot_mapping == [{}, {}] and ctx.all_moe_layers == ["moe.0", "moe.1"]


def test_create_copies_from_the_compilation_config() -> None:
    layers = {"attn.0": object()}
    cfg = VllmConfig(
        compilation_config=CompilationConfig(
            static_forward_context=layers, static_all_moe_layers=["moe.0", "moe.1"]
        )
    )
    slices = [UBatchSlice(slice(0, 1), slice(0, 4)), UBatchSlice(slice(1, 2), slice(4, 8))]
    ctx = create_forward_context(
        {"attn.0": "meta"}, cfg, virtual_engine=1, ubatch_slices=slices, skip_compiled=True
    )
    assert ctx.no_compile_layers is layers
    assert ctx.all_moe_layers == ["moe.0", "moe.1"] and ctx.moe_layer_index == 0
    assert ctx.attn_metadata == {"attn.0": "meta"}
    assert (ctx.virtual_engine, ctx.skip_compiled, ctx.ubatch_slices) == (1, True, slices)
    assert ctx.slot_mapping == {} and ctx.additional_kwargs == {}
    with pytest.raises(TypeError, match="vllm_config must be a VllmConfig, got None"):
        create_forward_context(None, None)  # type: ignore[arg-type]


def test_get_without_a_context_is_a_clear_error() -> None:
    assert is_forward_context_available() is False
    assert fc._forward_context is None
    with pytest.raises(RuntimeError, match="Forward context is not set"):
        get_forward_context()


def test_set_nests_and_restores_even_on_error() -> None:
    slots = {"attn.0": torch.arange(4)}
    with set_forward_context({"a": 1}, VllmConfig(), slot_mapping=slots) as entered:
        assert entered is None
        outer = get_forward_context()
        assert outer.attn_metadata == {"a": 1} and outer.slot_mapping is slots
        assert fc._forward_context is outer
        with pytest.raises(ZeroDivisionError):
            with set_forward_context({"b": 2}, VllmConfig(), virtual_engine=1):
                assert get_forward_context().virtual_engine == 1
                1 / 0
        assert get_forward_context() is outer
    assert is_forward_context_available() is False


def test_override_restores_the_previous_context_even_on_error() -> None:
    mine = create_forward_context("mine", VllmConfig())
    with set_forward_context("outer", VllmConfig()):
        outer = get_forward_context()
        with pytest.raises(KeyError):
            with override_forward_context(mine):
                assert get_forward_context() is mine
                raise KeyError("x")
        assert get_forward_context() is outer
        with override_forward_context(None):
            assert is_forward_context_available() is False
        assert get_forward_context() is outer
    with pytest.raises(TypeError, match="must be a ForwardContext or None, got 'ctx'"):
        with override_forward_context("ctx"):  # type: ignore[arg-type]
            pass


def test_threads_never_see_each_others_context() -> None:
    barrier = threading.Barrier(2)
    seen: dict[str, object] = {}

    def run(name: str) -> None:
        seen[f"{name}-before"] = is_forward_context_available()
        with set_forward_context(name, VllmConfig()):
            barrier.wait()  # both contexts are set now
            seen[name] = get_forward_context().attn_metadata
            barrier.wait()

    with set_forward_context("main", VllmConfig()):
        threads = [threading.Thread(target=run, args=(n,)) for n in ("t1", "t2")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert get_forward_context().attn_metadata == "main"
    assert seen == {"t1-before": False, "t2-before": False, "t1": "t1", "t2": "t2"}


def test_sessions_in_separate_contexts_enter_and_exit_in_separate_calls() -> None:
    # As the bridge does: each session has its own Context; enter and exit are two calls.
    session_a, session_b = contextvars.Context(), contextvars.Context()
    cm = set_forward_context("a", VllmConfig())
    session_a.run(cm.__enter__)
    assert session_a.run(lambda: get_forward_context().attn_metadata) == "a"
    assert session_b.run(is_forward_context_available) is False
    assert is_forward_context_available() is False
    session_a.run(cm.__exit__, None, None, None)
    assert session_a.run(is_forward_context_available) is False


def test_default_batch_descriptor_with_a_cudagraph_mode() -> None:
    with set_forward_context(None, VllmConfig(), num_tokens=64,
                             cudagraph_runtime_mode=CUDAGraphMode.FULL):
        assert get_forward_context().batch_descriptor == BatchDescriptor(num_tokens=64)
    given = BatchDescriptor(64, num_reqs=4, uniform=True)
    with set_forward_context(None, VllmConfig(), num_tokens=64,
                             cudagraph_runtime_mode="piecewise", batch_descriptor=given):
        ctx = get_forward_context()
        assert ctx.batch_descriptor is given
        assert ctx.cudagraph_runtime_mode is CUDAGraphMode.PIECEWISE
    with set_forward_context(None, VllmConfig(), num_tokens=64):
        assert get_forward_context().batch_descriptor is None
    with pytest.raises(ValueError, match="Invalid cudagraph runtime mode: FULL_AND_PIECEWISE"):
        with set_forward_context(None, VllmConfig(), num_tokens=64,
                                 cudagraph_runtime_mode=CUDAGraphMode.FULL_AND_PIECEWISE):
            pass
    assert is_forward_context_available() is False


def test_dp_metadata_from_given_counts() -> None:
    with set_forward_context({"a": 1}, DP2_RANK0, num_tokens=6,
                             num_tokens_across_dp=torch.tensor([6, 2])):
        meta = get_forward_context().dp_metadata
        assert meta.num_tokens_across_dp_cpu.tolist() == [6, 2]
        assert int(meta.max_tokens_across_dp_cpu) == 6


def test_no_dp_metadata_when_dp_is_off_non_moe_or_the_pass_is_empty() -> None:
    with set_forward_context({"a": 1}, VllmConfig(), num_tokens=6):
        assert get_forward_context().dp_metadata is None
    dense = VllmConfig(parallel_config=ParallelConfig(data_parallel_size=2, is_moe_model=False))
    with set_forward_context({"a": 1}, dense, num_tokens=6):
        assert get_forward_context().dp_metadata is None
    with set_forward_context(None, DP2_RANK0):  # no metadata, no token count
        assert get_forward_context().dp_metadata is None


def test_dp_errors_on_entry_leave_no_context_behind() -> None:
    with pytest.raises(ValueError, match=r"num_tokens_across_dp_cpu\[0\] is 5 .* is 6"):
        with set_forward_context({"a": 1}, DP2_RANK0, num_tokens=6,
                                 num_tokens_across_dp=torch.tensor([5, 6])):
            pass
    with pytest.raises(ValueError, match="num_tokens is required"):
        with set_forward_context({"a": 1}, DP2_RANK0):
            pass
    slices = [UBatchSlice(slice(0, 1), slice(0, 3)), UBatchSlice(slice(1, 2), slice(3, 6))]
    with pytest.raises(ValueError, match="ubatch_slices needs num_tokens_across_dp"):
        with set_forward_context({"a": 1}, DP2_RANK0, num_tokens=6, ubatch_slices=slices):
            pass
    with pytest.raises(DPGroupError, match="has not joined a DP group"):
        with set_forward_context({"a": 1}, DP2_RANK0, num_tokens=6):
            pass
    assert is_forward_context_available() is False


def test_set_refuses_bad_arguments_by_name() -> None:
    with pytest.raises(TypeError, match="vllm_config must be a VllmConfig, got {}"):
        with set_forward_context(None, {}):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -3"):
        with set_forward_context(None, VllmConfig(), num_tokens=-3):
            pass


def test_module_exposes_the_seed_attributes() -> None:
    for name in ("batchsize_forward_time", "batchsize_logging_interval", "forward_start_time",
                 "last_logging_time", "track_batchsize", "_forward_context", "logger",
                 "current_platform", "coordinate_batch_across_dp", "init_logger"):
        assert name in dir(fc), name
        getattr(fc, name)
    assert fc.init_logger("vllm_bridge.x").name == "vllm_bridge.x"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fc.nope  # noqa: B018
