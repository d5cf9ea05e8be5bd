"""Weights of the demo model: generated from a seed, saved to a file, loaded back with
checks.

File format: ``torch.save`` of a plain dict, readable with ``torch.load(weights_only=True)``
(no pickled code)::

    {"format": "vllm_bridge.moe", "version": 1, "seed": int,
     "config": ModelConfig.to_dict(), "state_dict": {name: tensor, ...}}

Tensors are stored unsharded, in the model's dtype. Loading checks the header, builds the
config, checks every tensor's name, shape and dtype against the config (naming the first
bad one), takes this rank's expert shard when experts are split over ranks, and loads the
model with ``load_state_dict(strict=True)``.
"""

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_bridge._checks import check_int
from vllm_bridge.demo.model.config import ModelConfig
from vllm_bridge.demo.model.moe import expert_shard

__all__ = [
    "FORMAT",
    "VERSION",
    "WeightsError",
    "WeightsFile",
    "generate_state_dict",
    "load_into",
    "read_weights",
    "save_weights",
    "shard_state_dict",
]

FORMAT = "vllm_bridge.moe"
VERSION = 1


class WeightsError(ValueError):
    """A weights file that cannot be read, or that does not fit the model."""


@dataclass(frozen=True)
class WeightsFile:
    """A weights file and what it holds.

    Attributes:
        path: Where it is.
        sha256: Hex digest of the file's bytes.
        seed: The seed the weights were generated from.
        config: The model shape it was made for.
        num_parameters: Number of scalars over all tensors (unsharded).
        num_bytes: Size of the file.
    """

    path: str
    sha256: str
    seed: int
    config: ModelConfig
    num_parameters: int
    num_bytes: int


def _init_scale(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a parameter's initial values."""
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name in ("embed.weight", "pos_embed.weight"):
        return 0.0, 1.0 if name == "embed.weight" else 0.2
    fan_in = shape[-2]
    if name.endswith("router"):
        return 0.0, 2.0 / fan_in**0.5
    return 0.0, 1.0 / fan_in**0.5


def generate_state_dict(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights drawn from ``seed``: the same seed gives the same bits.

    One CPU ``torch.Generator`` draws every parameter in model order, in float32; the
    values are then cast to the config's dtype.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {config!r}")
    check_int("seed", seed, minimum=0)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in config.parameter_shapes().items():
        mean, std = _init_scale(name, shape)
        values = torch.randn(shape, generator=generator, dtype=torch.float32) * std + mean
        state[name] = values.to(config.torch_dtype)
    return state


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_weights(path: str | os.PathLike[str], config: ModelConfig, seed: int) -> WeightsFile:
    """Generate the weights of ``config`` from ``seed`` and write them to ``path``.

    The file is written next to its final name and renamed into place, so a reader never
    sees half a file. Parent directories are created.
    """
    target = Path(path)
    state = generate_state_dict(config, seed)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "seed": seed,
        "config": config.to_dict(),
        "state_dict": state,
    }
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return _describe(target, seed, config, state)


def _describe(
    path: Path, seed: int, config: ModelConfig, state: dict[str, torch.Tensor]
) -> WeightsFile:
    return WeightsFile(
        path=str(path),
        sha256=_sha256(path),
        seed=seed,
        config=config,
        num_parameters=sum(t.numel() for t in state.values()),
        num_bytes=path.stat().st_size,
    )


def read_weights(path: str | os.PathLike[str]) -> tuple[WeightsFile, dict[str, torch.Tensor]]:
    """Read and check a weights file: its description and its full state dict.

    Raises:
        WeightsError: the file is missing, unreadable or corrupted, is not a weights file
            of this format and version, or a tensor is missing, unexpected, or of the
            wrong shape or dtype for the config it records (the message names it).
    """
    source = Path(path)
    if not source.is_file():
        raise WeightsError(f"weights file {str(source)!r} does not exist")
    try:
        payload = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several kinds for a damaged file
        raise WeightsError(
            f"cannot read weights file {str(source)!r} (damaged or not a torch file): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc
    where = f"weights file {str(source)!r}"
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise WeightsError(f"{where} is not a {FORMAT} file (format {found!r})")
    if payload.get("version") != VERSION:
        raise WeightsError(
            f"{where} has version {payload.get('version')!r}; this code reads {VERSION}"
        )
    try:
        config = ModelConfig.from_dict(payload.get("config"))
    except (TypeError, ValueError) as exc:
        raise WeightsError(f"{where} records a bad model config: {exc}") from exc
    seed = payload.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise WeightsError(f"{where} records a bad seed {seed!r}")
    state = payload.get("state_dict")
    if not isinstance(state, dict):
        raise WeightsError(f"{where} has no state_dict (got {type(state).__name__})")
    check_state_dict(state, config, where)
    return _describe(source, seed, config, state), state


def check_state_dict(state: dict[str, Any], config: ModelConfig, where: str) -> None:
    """Check names, shapes and dtypes of a full state dict against ``config``.

    Raises:
        WeightsError: naming the first missing, unexpected or mismatched tensor.
    """
    expected = config.parameter_shapes()
    missing = [k for k in expected if k not in state]
    if missing:
        raise WeightsError(f"{where} lacks tensor(s) {missing[:4]} of the model")
    unexpected = [str(k) for k in state if k not in expected]
    if unexpected:
        raise WeightsError(f"{where} has unexpected tensor(s) {unexpected[:4]}")
    for name, shape in expected.items():
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise WeightsError(f"{where}: {name} is a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != shape:
            raise WeightsError(
                f"{where}: {name} has shape {tuple(tensor.shape)}, the config needs {shape}"
            )
        if tensor.dtype != config.torch_dtype:
            raise WeightsError(
                f"{where}: {name} has dtype {tensor.dtype}, the config needs {config.dtype}"
            )


def shard_state_dict(
    state: dict[str, torch.Tensor], config: ModelConfig, ep_size: int, ep_rank: int
) -> dict[str, torch.Tensor]:
    """The state dict of expert-parallel rank ``ep_rank``: its slice of every expert
    tensor (dimension 0), everything else whole."""
    first, count = expert_shard(config.num_experts, ep_size, ep_rank)
    return {
        name: t[first : first + count] if config.is_expert_parameter(name) else t
        for name, t in state.items()
    }


def load_into(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(state, strict=True)``, copying onto the model's device.

    Raises:
        WeightsError: a key or shape does not match the model (torch's message).
    """
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise WeightsError(f"the weights do not fit the model: {exc}") from exc
