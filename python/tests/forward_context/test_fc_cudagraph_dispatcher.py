"""CudagraphDispatcher against an independent reference of vLLM's dispatch rule.

The reference (``expected``) is written from the rule as stated per mode, not from key
sets: a uniform decode gets a FULL decode graph when the configured mode decodes with FULL
graphs and the padded size holds at most ``max_num_seqs`` requests of ``q`` tokens
(two-routine modes), else whatever the mixed routine gives; a LoRA batch needs a graph for
its (rounded) adapter count. Generated configurations are checked against it over every
batch shape, and every listed capture descriptor must be one the reference can return.
"""

import itertools

import pytest

from vllm_bridge.config import CompilationConfig, LoRAConfig, SchedulerConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode as M
from vllm_bridge.cudagraph_dispatch import CudagraphDispatcher, dispatch_cudagraph
from vllm_bridge.forward_context import BatchDescriptor as BD

ALL_MODES = list(M)
SIZE_LISTS = [[], [1], [8], [1, 24], [1, 2, 4, 8], [2, 4, 6, 12], [4, 8, 16, 32, 64]]
MAX_NUM_SEQS = [1, 3, 4, 128]
QUERY_LENS = [1, 2]
LORA_CONFIGS = [
    None,
    LoRAConfig(max_loras=1),
    LoRAConfig(max_loras=3, specialize_active_lora=True),
    LoRAConfig(max_loras=6, specialize_active_lora=False),
]


def config(mode, sizes, max_num_seqs=128, lora=None, specialize=True) -> VllmConfig:
    return VllmConfig(
        compilation_config=CompilationConfig(
            cudagraph_mode=mode, cudagraph_capture_sizes=sizes,
            cudagraph_specialize_lora=specialize,
        ),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs),
        lora_config=lora,
    )


# -- the reference ----------------------------------------------------------------------------


def lora_graph_count(cfg: VllmConfig, active: int) -> int | None:
    """The adapter count of the graph this batch needs, or None when none is captured."""
    lora = cfg.lora_config
    if active == 0:
        # Graphs without LoRA exist unless LoRA graphs are captured unspecialized.
        return 0 if lora is None or cfg.compilation_config.cudagraph_specialize_lora else None
    top = lora.max_loras + 1
    # One graph for every LoRA batch unless both switches specialize per count.
    if not (lora.specialize_active_lora and cfg.compilation_config.cudagraph_specialize_lora):
        return top
    # Rounded up to a power of two, or to max_loras + 1 when that is smaller.
    power = 1
    while power < active:
        power *= 2
    return min(power, top)


def expected(cfg: VllmConfig, q: int, n: int, uniform: bool, active: int, disable_full: bool):
    mode = cfg.compilation_config.cudagraph_mode
    sizes = cfg.compilation_config.cudagraph_capture_sizes
    fits = [s for s in sizes if s >= n]
    eager = (M.NONE, BD(n))
    loras = lora_graph_count(cfg, active)
    if mode is M.NONE or n == 0 or not fits or loras is None:
        return eager
    padded = fits[0]
    lora_fields = {"has_lora": active > 0, "num_active_loras": loras}
    relaxed = BD(padded, **lora_fields)
    decode, mixed = mode.decode_mode(), mode.mixed_mode()
    if uniform and not disable_full and decode is M.FULL:
        two_routines = mode in (M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE)
        if two_routines and padded <= q * cfg.scheduler_config.max_num_seqs:
            return M.FULL, BD(padded, padded // q, True, **lora_fields)
    if mixed is M.FULL and not disable_full:
        return M.FULL, relaxed
    if mixed is M.PIECEWISE:
        return M.PIECEWISE, relaxed
    return eager


def sizes_ok(mode: M, sizes: list[int], q: int) -> bool:
    """The dispatcher refuses FULL-capable configs with sizes a uniform batch cannot fill."""
    return not mode.has_mode(M.FULL) or all(s < q or s % q == 0 for s in sizes)


def generated():
    for mode, sizes, mns, q, lora, spec in itertools.product(
        ALL_MODES, SIZE_LISTS, MAX_NUM_SEQS, QUERY_LENS, LORA_CONFIGS, [True, False]
    ):
        if lora is None and not spec:
            continue  # cudagraph_specialize_lora is read only with LoRA on
        if sizes_ok(mode, sizes, q):
            yield config(mode, sizes, mns, lora, spec), q


def batches(cfg: VllmConfig, q: int):
    largest = max(cfg.compilation_config.cudagraph_capture_sizes, default=0)
    max_loras = cfg.lora_config.max_loras if cfg.lora_config else 0
    for n, uniform, active, disable in itertools.product(
        range(largest + 3), [False, True], range(max_loras + 1), [False, True]
    ):
        if not uniform or n % q == 0:
            yield n, uniform, active, disable


# -- the tests --------------------------------------------------------------------------------


def test_issue_16_examples() -> None:
    cfg = config(M.FULL_AND_PIECEWISE, [8], max_num_seqs=3)
    assert CudagraphDispatcher(cfg).dispatch(2, uniform_decode=True) == (M.PIECEWISE, BD(8))
    assert dispatch_cudagraph(cfg, 2, True) == (M.PIECEWISE, 8)
    cfg = config(M.FULL_DECODE_ONLY, [1, 24], max_num_seqs=3)
    assert CudagraphDispatcher(cfg).dispatch(2, uniform_decode=True) == (M.NONE, BD(2))
    assert dispatch_cudagraph(cfg, 2, True) == (M.NONE, 2)


def test_generated_configurations_match_the_reference() -> None:
    checked = outcomes = 0
    seen_modes = set()
    for cfg, q in generated():
        dispatcher = CudagraphDispatcher(cfg, uniform_decode_query_len=q)
        for n, uniform, active, disable in batches(cfg, q):
            want = expected(cfg, q, n, uniform, active, disable)
            got = dispatcher.dispatch(n, uniform, active > 0, disable, active)
            assert got == want, (cfg, q, n, uniform, active, disable)
            seen_modes.add(got[0])
            checked += 1
        outcomes += 1
    # The generation reaches every runtime mode, over many configurations.
    assert seen_modes == {M.NONE, M.PIECEWISE, M.FULL}
    assert outcomes > 500 and checked > 50_000


def test_capture_descriptors_are_exactly_what_dispatch_can_return() -> None:
    for cfg, q in generated():
        dispatcher = CudagraphDispatcher(cfg, uniform_decode_query_len=q)
        listed = dispatcher.capture_descriptors()
        assert [mode for mode, _ in listed] == [
            m for m in (M.PIECEWISE, M.FULL) if dispatcher.cudagraph_keys[m]
        ]
        captured = {(mode, d) for mode, descs in listed for d in descs}
        assert captured == {(m, d) for m, keys in dispatcher.cudagraph_keys.items() for d in keys}
        for _, descs in listed:
            assert [d.num_tokens for d in descs] == sorted((d.num_tokens for d in descs), reverse=True)
        # Every graph dispatch can ask for is listed, and every listed one is asked for by
        # some batch (no graph is captured in vain).
        reachable = set()
        for n, uniform, active, disable in batches(cfg, q):
            mode, desc = expected(cfg, q, n, uniform, active, disable)
            if mode is not M.NONE:
                reachable.add((mode, desc))
        assert captured == reachable, (cfg, q)


def test_decode_graphs_are_limited_by_max_num_seqs_and_query_len() -> None:
    sizes = [1, 2, 4, 8, 16, 32]
    cfg = config(M.FULL_AND_PIECEWISE, sizes, max_num_seqs=4)
    full = CudagraphDispatcher(cfg, uniform_decode_query_len=2).cudagraph_keys[M.FULL]
    assert full == {BD(2, 1, True), BD(4, 2, True), BD(8, 4, True)}  # 2 <= size <= 2 * 4
    assert CudagraphDispatcher(cfg, uniform_decode_query_len=2).dispatch(10, True) == (
        M.PIECEWISE, BD(16)
    )
    # Plain FULL has no separate decode keys: its mixed keys serve decodes, relaxed.
    plain = CudagraphDispatcher(config(M.FULL, sizes, max_num_seqs=1))
    assert plain.cudagraph_keys[M.FULL] == {BD(s) for s in sizes}
    assert plain.dispatch(5, True) == (M.FULL, BD(8))


def test_disable_full_falls_back_to_piecewise_or_none() -> None:
    both = CudagraphDispatcher(config(M.FULL_AND_PIECEWISE, [4]))
    assert both.dispatch(3, True) == (M.FULL, BD(4, 4, True))
    assert both.dispatch(3, True, disable_full=True) == (M.PIECEWISE, BD(4))
    assert CudagraphDispatcher(config(M.FULL, [4])).dispatch(3, disable_full=True) == (
        M.NONE, BD(3)
    )


def test_lora_graphs_round_the_adapter_count_up() -> None:
    cfg = config(M.PIECEWISE, [4], lora=LoRAConfig(max_loras=5, specialize_active_lora=True))
    dispatcher = CudagraphDispatcher(cfg)
    counts = sorted(d.num_active_loras for d in dispatcher.cudagraph_keys[M.PIECEWISE])
    assert counts == [0, 1, 2, 4, 6]
    assert dispatcher.dispatch(4, has_lora=True, num_active_loras=3) == (
        M.PIECEWISE, BD(4, has_lora=True, num_active_loras=4)
    )
    assert dispatcher.dispatch(4, has_lora=True, num_active_loras=5)[1].num_active_loras == 6
    unspecialized = CudagraphDispatcher(config(M.PIECEWISE, [4], lora=LoRAConfig(2), specialize=False))
    assert unspecialized.dispatch(4) == (M.NONE, BD(4))  # only LoRA graphs are captured
    assert unspecialized.dispatch(4, has_lora=True, num_active_loras=1) == (
        M.PIECEWISE, BD(4, has_lora=True, num_active_loras=3)
    )


def test_an_explicit_mode_overrides_the_configured_one() -> None:
    cfg = config(M.FULL_AND_PIECEWISE, [4])
    dispatcher = CudagraphDispatcher(cfg, cudagraph_mode=M.PIECEWISE)
    assert dispatcher.cudagraph_keys == {M.PIECEWISE: {BD(4)}, M.FULL: frozenset()}
    assert dispatcher.dispatch(4, True) == (M.PIECEWISE, BD(4))
    assert CudagraphDispatcher(cfg, cudagraph_mode=M.NONE).capture_descriptors() == []


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"num_tokens": -1}, ValueError, "num_tokens must be >= 0, got -1"),
        ({"num_tokens": 2.0}, TypeError, "num_tokens must be an int, got 2.0"),
        ({"num_tokens": 2, "uniform_decode": 1}, TypeError, "uniform_decode must be a bool, got 1"),
        ({"num_tokens": 2, "disable_full": None}, TypeError, "disable_full must be a bool, got None"),
        ({"num_tokens": 3, "uniform_decode": True}, ValueError, "num_tokens 3 of a uniform-decode"),
        ({"num_tokens": 2, "has_lora": True}, ValueError, "has_lora=True disagrees with num_active_loras=0"),
        ({"num_tokens": 2, "num_active_loras": 1}, ValueError, "has_lora=False disagrees"),
        ({"num_tokens": 2, "has_lora": True, "num_active_loras": 3}, ValueError, "num_active_loras 3 exceeds max_loras 2"),
    ],
)
def test_bad_batches_are_named(kwargs, exc, needle) -> None:
    dispatcher = CudagraphDispatcher(
        config(M.FULL_AND_PIECEWISE, [2, 4], lora=LoRAConfig(2)), uniform_decode_query_len=2
    )
    with pytest.raises(exc, match=needle):
        dispatcher.dispatch(**kwargs)


def test_lora_batch_without_lora_config_is_named() -> None:
    with pytest.raises(ValueError, match="has_lora=True, but no lora_config is set"):
        CudagraphDispatcher(config(M.PIECEWISE, [4])).dispatch(4, has_lora=True, num_active_loras=1)


def test_bad_construction_is_named() -> None:
    with pytest.raises(TypeError, match="vllm_config must be a VllmConfig"):
        CudagraphDispatcher(CompilationConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="uniform_decode_query_len must be >= 1, got 0"):
        CudagraphDispatcher(VllmConfig(), uniform_decode_query_len=0)
    with pytest.raises(TypeError, match="cudagraph_mode must be a CUDAGraphMode"):
        CudagraphDispatcher(VllmConfig(), cudagraph_mode="full")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="entry 3 is not a multiple of uniform_decode_query_len 2"):
        CudagraphDispatcher(config(M.FULL, [1, 2, 3]), uniform_decode_query_len=2)
    # Without FULL graphs num_reqs is never derived, so odd sizes are fine.
    CudagraphDispatcher(config(M.PIECEWISE, [1, 2, 3]), uniform_decode_query_len=2)
    for mode in (M.NONE, M.FULL_DECODE_ONLY):
        with pytest.raises(ValueError, match=f"must be PIECEWISE or FULL for a graph key, got {mode.name}"):
            CudagraphDispatcher(VllmConfig()).add_cudagraph_key(mode, BD(1))


@pytest.mark.parametrize(
    ("build", "exc", "needle"),
    [
        (lambda: SchedulerConfig(max_num_seqs=0), ValueError, "max_num_seqs must be >= 1, got 0"),
        (lambda: SchedulerConfig(max_num_seqs="8"), TypeError, "max_num_seqs must be an int, got '8'"),
        (lambda: LoRAConfig(max_loras=0), ValueError, "max_loras must be >= 1, got 0"),
        (lambda: LoRAConfig(specialize_active_lora=1), TypeError, "specialize_active_lora must be a bool, got 1"),
        (lambda: CompilationConfig(cudagraph_specialize_lora=None), TypeError, "cudagraph_specialize_lora must be a bool, got None"),
        (lambda: VllmConfig(scheduler_config=3), TypeError, "scheduler_config must be a SchedulerConfig, got 3"),
        (lambda: VllmConfig(lora_config={}), TypeError, r"lora_config must be a LoRAConfig or None, got \{\}"),
    ],
)
def test_bad_config_fields_are_named(build, exc, needle) -> None:
    with pytest.raises(exc, match=needle):
        build()


def test_new_config_fields_have_vllms_defaults() -> None:
    cfg = VllmConfig()
    assert cfg.scheduler_config.max_num_seqs == 128
    assert cfg.lora_config is None
    assert cfg.compilation_config.cudagraph_specialize_lora is True
    assert (LoRAConfig().max_loras, LoRAConfig().specialize_active_lora) == (1, False)
