"""The graph manager: which descriptors it captures, which step hits which key or falls
back (and says why), that its runs compute what the eager model computes, and that the
model's forward has no host sync (so a CUDA graph can hold it). The CUDA tests run where a
CUDA device is present."""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runner_schedules import make_schedule, merge
from vllm_bridge.config import CompilationConfig, ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.demo.batch import SchedulerStep
from vllm_bridge.demo.graphs import ForwardInputs, GraphManager
from vllm_bridge.demo.model.config import ModelConfig
from vllm_bridge.demo.model.layers import AttentionMetadata
from vllm_bridge.demo.model.moe import MoE
from vllm_bridge.demo.model.transformer import MoETransformer
from vllm_bridge.demo.model.weights import save_weights
from vllm_bridge.demo.model_runner import ModelRunner
from vllm_bridge.forward_context import BatchDescriptor, create_forward_context, override_forward_context

MODEL = ModelConfig(num_layers=2, max_model_len=96)
SIZES = [1, 2, 4, 8]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_weights(tmp_path_factory.mktemp("w") / "w.pt", MODEL, seed=4).path


def _runner(path: str, mode: str, device: str = "cpu", max_num_reqs: int = 64,
            sizes: list[int] = SIZES) -> ModelRunner:
    config = VllmConfig(
        parallel_config=ParallelConfig(is_moe_model=True),
        compilation_config=CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=sizes),
    )
    runner = ModelRunner(config, MODEL, device=device, max_num_reqs=max_num_reqs)
    runner.load_model(path)
    return runner


def _full(n: int) -> BatchDescriptor:
    return BatchDescriptor(num_tokens=n, num_reqs=n, uniform=True)


def _piecewise(n: int) -> BatchDescriptor:
    return BatchDescriptor(num_tokens=n, num_reqs=None, uniform=False)


# -- bookkeeping (CPU) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("full_and_piecewise",
         {**{_full(n): CUDAGraphMode.FULL for n in SIZES},
          **{_piecewise(n): CUDAGraphMode.PIECEWISE for n in SIZES}}),
        # PIECEWISE keys are relaxed: one graph per size serves decode and mixed batches.
        ("piecewise", {_piecewise(n): CUDAGraphMode.PIECEWISE for n in SIZES}),
        ("full_decode_only", {_full(n): CUDAGraphMode.FULL for n in SIZES}),
        ("none", {}),
    ],
)
def test_the_runner_captures_every_descriptor_the_dispatcher_can_return(
    weights: str, mode: str, expected: dict
) -> None:
    runner = _runner(weights, mode)
    assert runner.graph_descriptors() == expected
    report = runner.graphs.report
    assert report.captured == expected and report.skipped == {}
    assert runner.graphs.descriptors() == expected
    # No CUDA here: nothing is a real graph, and no device memory is claimed.
    assert report.num_graphs == 0 and report.memory_bytes is None


def test_decode_graphs_beyond_max_num_reqs_are_not_captured(weights: str) -> None:
    runner = _runner(weights, "full_and_piecewise", max_num_reqs=2)
    assert {d for d in runner.graphs.descriptors() if d.uniform} == {_full(1), _full(2)}


def test_a_decode_padded_past_max_num_reqs_takes_the_mixed_graph_not_eager(
    weights: str,
) -> None:
    # 5 decodes pad to 8, more requests than the runner holds (6): the dispatcher (its
    # max_num_seqs capped by max_num_reqs) never offers the FULL decode key it would not
    # capture, and the step takes the PIECEWISE graph of 8 instead of running eagerly.
    runner = _runner(weights, "full_and_piecewise", max_num_reqs=6)
    prompts = {r: [5 + i, 20 + i] for i, r in enumerate("abcde")}
    runner.execute_model(SchedulerStep({r: 2 for r in prompts}, prompts))
    decode = runner.execute_model(SchedulerStep({r: 1 for r in prompts}))
    assert (decode.batch_descriptor, decode.cudagraph_mode) == (_piecewise(8), "PIECEWISE")
    assert (decode.graph, decode.graph_reason) == ("emulated", None)
    captured = runner.graphs.descriptors()
    assert _full(4) in captured and _full(8) not in captured


def test_each_step_hits_its_key_or_runs_eagerly_and_says_why(weights: str) -> None:
    runner = _runner(weights, "full_and_piecewise")
    prompts = {r: [3 + i, 40 + i] for i, r in enumerate("abc")}
    mixed = runner.execute_model(SchedulerStep({r: 2 for r in prompts}, prompts))
    assert (mixed.batch_descriptor, mixed.cudagraph_mode) == (_piecewise(8), "PIECEWISE")
    assert (mixed.graph, mixed.graph_reason) == ("emulated", None)
    decode = runner.execute_model(SchedulerStep({r: 1 for r in prompts}))
    assert (decode.batch_descriptor, decode.cudagraph_mode) == (_full(4), "FULL")
    assert (decode.graph, decode.graph_reason) == ("emulated", None)
    big = runner.execute_model(SchedulerStep({"d": 9}, {"d": list(range(9))}))
    assert big.cudagraph_mode == "NONE" and big.num_tokens_padded == 9
    assert (big.graph, big.graph_reason) == ("eager", "runtime mode NONE")
    assert runner.graphs.hits == {_piecewise(8): 1, _full(4): 1}


def test_a_descriptor_without_a_graph_runs_eagerly_and_names_it(weights: str) -> None:
    runner = _runner(weights, "full_decode_only")
    graphs, n = runner.graphs, 4
    inputs = ForwardInputs(torch.arange(n), torch.arange(n), torch.arange(n))
    names = list(runner.vllm_config.compilation_config.static_forward_context)
    meta = AttentionMetadata([0, n], [0], [0], n)

    def context():  # one per pass: a pass walks the context's MoE layer order
        return override_forward_context(create_forward_context(
            {k: meta for k in names}, runner.vllm_config,
            slot_mapping={k: inputs.slot_mapping for k in names}))

    with torch.inference_mode():
        with context():
            missing = graphs.run(_piecewise(n), CUDAGraphMode.PIECEWISE, inputs)
        with context():
            other = graphs.run(_full(n), CUDAGraphMode.PIECEWISE, inputs)
    assert missing.how == "eager" and str(_piecewise(n)) in missing.reason
    assert other.how == "eager" and "captured as FULL" in other.reason
    torch.testing.assert_close(missing.hidden, other.hidden, rtol=0, atol=0)
    assert graphs.hits == {}


def test_full_graphs_are_not_captured_around_dp_collectives() -> None:
    with torch.device("meta"):
        model = MoETransformer(MODEL, dp_size=2, dp_rank=0)
    graphs = GraphManager(model, torch.device("cpu"), lambda *a: pytest.fail("captured"))
    report = graphs.capture({_full(2): CUDAGraphMode.FULL})
    assert report.captured == {} and "DP collectives" in report.skipped[_full(2)]


def test_capture_refuses_bad_descriptors_by_name(weights: str) -> None:
    runner = _runner(weights, "none")
    with pytest.raises(ValueError, match="NONE"):
        runner.graphs.capture({_full(2): CUDAGraphMode.NONE})
    with pytest.raises(TypeError, match="BatchDescriptor"):
        runner.graphs.capture({(2, 2): CUDAGraphMode.FULL})


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_graph_runs_give_the_eager_tokens_and_logits(weights: str, seed: int) -> None:
    graph, eager = _runner(weights, "full_and_piecewise"), _runner(weights, "none")
    hows = set()
    for row in make_schedule(seed=seed, num_steps=8):
        step = vars(merge(row))
        a, b = graph.execute_model(SchedulerStep(**step)), eager.execute_model(SchedulerStep(**step))
        hows.add(a.graph)
        assert b.graph == "eager"
        assert (a.req_ids, a.sampled_token_ids) == (b.req_ids, b.sampled_token_ids)
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    assert "emulated" in hows


# -- no host sync in the forward pass ------------------------------------------------------


class _NoHostSync(TorchDispatchMode):
    """Fails on every op that reads a tensor's value on the host or makes a shape from
    values. Every host read of a tensor value (``item()``, ``int(t)``, ``bool(t)``, a
    Python ``if`` on a tensor) goes through ``aten._local_scalar_dense``; ``nonzero``,
    ``masked_select`` and ``unique`` size their output from the values. On CUDA these are
    exactly the ops that synchronise with the host or cannot be captured."""

    FORBIDDEN = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "unique_dim",
                 "_unique", "_unique2", "unique_consecutive", "repeat_interleave", "item"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.overloadpacket.__name__ in self.FORBIDDEN:
            raise RuntimeError(f"host sync in the forward pass: {func}")
        return func(*args, **(kwargs or {}))


@contextmanager
def _context(model: MoETransformer, slots: torch.Tensor, n: int) -> Iterator[None]:
    config = VllmConfig(parallel_config=ParallelConfig(is_moe_model=True))
    names = list(model.attention_layers())
    meta = AttentionMetadata([0, n], [0], [0], n)
    ctx = create_forward_context({k: meta for k in names}, config,
                                 slot_mapping={k: slots for k in names})
    with override_forward_context(ctx):
        yield


def _model(device: str) -> MoETransformer:
    with torch.device(device):
        model = MoETransformer(MODEL)
        for p in model.parameters():
            if device != "meta":
                torch.nn.init.normal_(p, std=0.2)
        for layer in model.attention_layers().values():
            layer.bind_kv_cache(2 * MODEL.max_model_len)
    return model


def test_the_forward_pass_has_no_host_sync() -> None:
    model, n = _model("cpu"), 6
    slots = torch.tensor([0, 1, 2, 3, -1, -1])
    with torch.inference_mode(), _context(model, slots, n), _NoHostSync():
        out = model(torch.arange(n), torch.tensor([0, 1, 2, 3, 0, 0]))
    assert out.shape == (n, MODEL.hidden_size) and torch.isfinite(out).all()


def test_the_forward_pass_runs_on_the_meta_device() -> None:
    """Meta tensors have shapes and no values: any host read or value-made shape raises."""
    model, n = _model("meta"), 5
    slots = torch.arange(n, device="meta")
    with torch.inference_mode(), _context(model, slots, n):
        out = model(torch.arange(n, device="meta"), torch.arange(n, device="meta"))
    assert out.shape == (n, MODEL.hidden_size) and out.device.type == "meta"


def test_the_check_catches_a_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: routing that gathers tokens with nonzero (as the MoE did before
    it was made capturable) is caught, on the CPU and on the meta device."""
    def gathering(self: MoE, h: torch.Tensor) -> torch.Tensor:
        rows = torch.nonzero(h[:, 0] > 0)
        return h.new_zeros(h.shape[0], self.top_k, h.shape[1]) + rows.numel()

    monkeypatch.setattr(MoE, "_contributions", gathering)
    model, n = _model("cpu"), 3
    with torch.inference_mode(), _context(model, torch.arange(n), n):
        with pytest.raises(RuntimeError, match="host sync"), _NoHostSync():
            model(torch.arange(n), torch.arange(n))
    meta, slots = _model("meta"), torch.arange(n, device="meta")
    with torch.inference_mode(), _context(meta, slots, n), pytest.raises(NotImplementedError):
        meta(torch.arange(n, device="meta"), torch.arange(n, device="meta"))


# -- on CUDA -------------------------------------------------------------------------------


def _decode_and_mixed_steps(size: int) -> list[SchedulerStep]:
    """Prefill ``size`` requests (one mixed step of 2 tokens each), then two decode steps
    of ``size`` requests: a mixed batch and uniform decodes at this size."""
    prompts = {f"r{i}": [5 + i, 7 + 2 * i] for i in range(size)}
    return [SchedulerStep({r: 2 for r in prompts}, prompts),
            SchedulerStep({r: 1 for r in prompts}),
            SchedulerStep({r: 1 for r in prompts}, finished=[])]


@needs_cuda
@pytest.mark.parametrize("mode", ["full_and_piecewise", "piecewise"])
def test_on_cuda_replay_gives_the_eager_tokens_and_logits(weights: str, mode: str) -> None:
    graph = _runner(weights, mode, device="cuda", sizes=[1, 2, 4, 8, 16])
    report = graph.graphs.report
    assert report.num_graphs > 0 and report.memory_bytes is not None
    replayed = set()
    for size in [1, 2, 3, 4, 8]:
        eager = _runner(weights, "none", device="cuda")
        graph_steps = _decode_and_mixed_steps(size)
        for step, twin in zip(graph_steps, _decode_and_mixed_steps(size)):
            a, b = graph.execute_model(step), eager.execute_model(twin)
            assert a.graph == "replay", (size, a.batch_descriptor, a.graph_reason)
            replayed.add((a.cudagraph_mode, a.num_tokens_padded))
            assert (a.req_ids, a.sampled_token_ids) == (b.req_ids, b.sampled_token_ids)
            torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
        graph.execute_model(SchedulerStep({}, finished=list(graph.requests)))
    want = {"PIECEWISE"} if mode == "piecewise" else {"PIECEWISE", "FULL"}
    assert {m for m, _ in replayed} == want
    assert {n for _, n in replayed} >= {1, 2, 4, 8, 16}


@needs_cuda
def test_on_cuda_a_step_without_a_graph_runs_eagerly(weights: str) -> None:
    runner = _runner(weights, "full_and_piecewise", device="cuda", sizes=[1, 2])
    out = runner.execute_model(SchedulerStep({"a": 3}, {"a": [1, 2, 3]}))
    assert (out.cudagraph_mode, out.graph, out.graph_reason) == ("NONE", "eager", "runtime mode NONE")
    runner.execute_model(SchedulerStep({}, {"b": [4]}))
    runner.requests["a"].token_ids.append(9)  # a second pending token for "a"
    out = runner.execute_model(SchedulerStep({"a": 2}))
    assert (out.batch_descriptor, out.graph) == (_piecewise(2), "replay")
