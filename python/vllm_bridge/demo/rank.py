"""The demo's per-rank entry points, the calls the Elixir side makes on each DP rank.

One model runner per worker process (one DP rank).

A worker process is one DP rank with one device, as a vLLM worker is, so the runner lives
in the process (module state), not in a session. The Elixir side drives it with plain
calls::

    save_weights(path, seed)                     # once, anywhere: generate + write a file
    vllm_bridge.dp.init_dp_group()               # every rank together (VLLM_DP_* env)
    create_runner(enable_dbo=True, ...)          # every rank; DP size/rank from the group
    load_model(path)                             # every rank: read, check, shard, load
    execute_model(num_scheduled_tokens, new_requests, finished)   # every rank, each step
    shutdown_runner(); vllm_bridge.dp.destroy_dp_group()

Everything returned is plain data (dicts, lists, numbers, strings, CPU tensors) so that it
reads the same on both sides. See :mod:`vllm_bridge.demo.model_runner` for what a step does.

This module is not on the workers' default allow-list (``vllm_bridge.PUBLIC_MODULES``):
``save_weights`` and ``load_model`` write and read files at paths their caller names, so a
pool must allow it by name (the pool option ``modules: ["vllm_bridge.demo.rank"]``), and
its callers may then write files wherever the worker's user can. Only the demo's pools do.
"""

import dataclasses
from typing import Any

import torch

from vllm_bridge.config import CompilationConfig, ParallelConfig, VllmConfig
from vllm_bridge.demo.batch import SchedulerStep
from vllm_bridge.demo.model.config import ModelConfig
from vllm_bridge.demo.model.weights import WeightsFile
from vllm_bridge.demo.model.weights import save_weights as _save_weights
from vllm_bridge.demo.model_runner import ModelRunner, StepOutput
from vllm_bridge.dp import dp_group_info
from vllm_bridge.platforms import rank_device

__all__ = [
    "DEFAULT_CAPTURE_SIZES",
    "create_runner",
    "execute_model",
    "load_model",
    "request_tokens",
    "runner_info",
    "save_weights",
    "shutdown_runner",
]

#: Capture sizes of the CUDA-graph configuration when none are given: as vLLM's default,
#: 1, 2, 4, then every multiple of 8 (here up to 128).
DEFAULT_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, *range(8, 129, 8))

_runner: ModelRunner | None = None


def _weights_dict(info: WeightsFile) -> dict[str, Any]:
    return {
        "path": info.path,
        "sha256": info.sha256,
        "seed": info.seed,
        "config": info.config.to_dict(),
        "num_parameters": info.num_parameters,
        "num_bytes": info.num_bytes,
    }


def save_weights(path: str, seed: int = 0, model: dict[str, Any] | None = None) -> dict[str, Any]:
    """Generate the weights of a model (``model``: :class:`ModelConfig` fields, default
    the default config) from ``seed`` and write them to ``path``.

    Returns:
        ``{"path", "sha256", "seed", "config", "num_parameters", "num_bytes"}``.
    """
    if not isinstance(path, str) or not path:
        raise TypeError(f"path must be a non-empty str, got {path!r}")
    config = ModelConfig.from_dict(model or {})
    return _weights_dict(_save_weights(path, config, seed))


def create_runner(
    data_parallel_size: int | None = None,
    data_parallel_rank: int | None = None,
    enable_expert_parallel: bool = True,
    enable_dbo: bool = False,
    dbo_prefill_token_threshold: int = 512,
    dbo_decode_token_threshold: int = 32,
    cudagraph_mode: str = "full_and_piecewise",
    cudagraph_capture_sizes: list[int] | None = None,
    max_num_reqs: int = 64,
    moe_chunk_size: int = 32,
    device: str | None = None,
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Create this process's runner (replacing any earlier one).

    ``data_parallel_size`` / ``data_parallel_rank`` default to the DP group this process
    joined (:func:`vllm_bridge.dp.init_dp_group`), or 1 / 0 when it joined none. The model
    is an MoE model; ``model`` (ModelConfig fields) fixes its shape, else the weights file
    does. ``cudagraph_mode`` is a :class:`~vllm_bridge.cudagraph.CUDAGraphMode` name.
    ``device`` defaults to ``cuda:<rank modulo the GPU count>`` when CUDA is available,
    else ``cpu``.

    Returns:
        :func:`runner_info`.
    """
    global _runner
    group = dp_group_info()
    if data_parallel_size is None:
        data_parallel_size = group.world_size if group is not None else 1
    if data_parallel_rank is None:
        data_parallel_rank = group.rank if group is not None else 0
    parallel = ParallelConfig(
        data_parallel_size=data_parallel_size,
        data_parallel_rank=data_parallel_rank,
        is_moe_model=True,
        enable_expert_parallel=enable_expert_parallel,
        enable_dbo=enable_dbo,
        dbo_prefill_token_threshold=dbo_prefill_token_threshold,
        dbo_decode_token_threshold=dbo_decode_token_threshold,
    )
    sizes = DEFAULT_CAPTURE_SIZES if cudagraph_capture_sizes is None else cudagraph_capture_sizes
    sizes = list(sizes)
    compilation = CompilationConfig(cudagraph_mode=cudagraph_mode, cudagraph_capture_sizes=sizes)
    model_config = ModelConfig.from_dict(model) if model is not None else None
    if device is None and torch.cuda.is_available():
        device = rank_device(data_parallel_rank)
    runner = ModelRunner(
        VllmConfig(parallel_config=parallel, compilation_config=compilation),
        model_config,
        device=device,
        max_num_reqs=max_num_reqs,
        moe_chunk_size=moe_chunk_size,
    )
    _runner = runner
    return runner_info()


def _current() -> ModelRunner:
    if _runner is None:
        raise RuntimeError(
            "no runner in this worker: call vllm_bridge.demo.rank.create_runner first"
        )
    return _runner


def load_model(path: str) -> dict[str, Any]:
    """Load the weights file at ``path`` into this process's runner (see
    :meth:`ModelRunner.load_model`); returns what :func:`save_weights` returns."""
    return _weights_dict(_current().load_model(path))


def execute_model(
    num_scheduled_tokens: dict[str, int],
    new_requests: dict[str, list[int]] | None = None,
    finished: list[str] | None = None,
) -> dict[str, Any]:
    """Run one step on this rank (every DP rank must call it for every step).

    Args:
        num_scheduled_tokens: Tokens to compute now, by request id.
        new_requests: Prompts of the requests that start now.
        finished: Requests to forget first.

    Returns:
        The fields of :class:`~vllm_bridge.demo.model_runner.StepOutput` as a dict, with
        ``batch_descriptor`` as a dict (or ``None``) and ``logits`` a CPU float32 tensor.
    """
    step = SchedulerStep(num_scheduled_tokens, new_requests or {}, finished or [])
    return _step_dict(_current().execute_model(step))


def _step_dict(out: StepOutput) -> dict[str, Any]:
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    descriptor = out.batch_descriptor
    fields["batch_descriptor"] = dataclasses.asdict(descriptor) if descriptor else None
    return fields


def request_tokens(req_id: str) -> list[int]:
    """Every known token of a running request: its prompt, then the sampled ones."""
    return _current().request_tokens(req_id)


def runner_info() -> dict[str, Any]:
    """This process's runner: DP rank and size, expert shard, device, model, weights."""
    runner = _current()
    model = runner.model
    info: dict[str, Any] = {
        "data_parallel_size": runner.dp_size,
        "data_parallel_rank": runner.dp_rank,
        "expert_parallel": runner.expert_parallel,
        "enable_dbo": runner.parallel_config.enable_dbo,
        "cudagraph_mode": runner.vllm_config.compilation_config.cudagraph_mode.name,
        "device": str(runner.device),
        "model": runner.model_config.to_dict() if runner.model_config else None,
        "weights_sha256": runner.weights.sha256 if runner.weights else None,
        "local_experts": None,
        "running_requests": len(runner.requests),
    }
    if model is not None:
        moe = model.layers[0].moe
        info["local_experts"] = [moe.first_expert, moe.first_expert + moe.num_local - 1]
    return info


def shutdown_runner() -> bool:
    """Drop this process's runner (its model and KV caches); True if there was one."""
    global _runner
    had, _runner = _runner is not None, None
    return had
