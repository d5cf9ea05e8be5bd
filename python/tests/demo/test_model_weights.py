"""Weights of the demo model: seeded generation, the file format, and loading errors that
name what is wrong."""

from pathlib import Path

import pytest
import torch

from vllm_bridge.demo.model.config import ModelConfig
from vllm_bridge.demo.model.transformer import MoETransformer
from vllm_bridge.demo.model.weights import (
    FORMAT,
    WeightsError,
    generate_state_dict,
    load_into,
    read_weights,
    save_weights,
    shard_state_dict,
)

SMALL = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_experts=4,
                    top_k=2, intermediate_size=8, max_model_len=16)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_same_seed_gives_the_same_bits_and_another_seed_does_not() -> None:
    assert _same(generate_state_dict(SMALL, 3), generate_state_dict(SMALL, 3))
    other = generate_state_dict(SMALL, 4)
    assert not any(torch.equal(other[k], v) for k, v in generate_state_dict(SMALL, 3).items())


def test_generated_tensors_have_the_config_shapes_and_dtype() -> None:
    config = ModelConfig(**{**SMALL.to_dict(), "dtype": "float64"})
    state = generate_state_dict(config, 0)
    assert {k: tuple(v.shape) for k, v in state.items()} == config.parameter_shapes()
    assert {v.dtype for v in state.values()} == {torch.float64}


def test_save_then_read_round_trips_and_describes_the_file(tmp_path: Path) -> None:
    info = save_weights(tmp_path / "sub" / "w.pt", SMALL, seed=9)
    read, state = read_weights(info.path)
    assert read == info
    assert info.seed == 9 and info.config == SMALL
    assert info.num_parameters == sum(
        torch.Size(s).numel() for s in SMALL.parameter_shapes().values()
    )
    assert info.num_bytes == Path(info.path).stat().st_size and len(info.sha256) == 64
    assert _same(state, generate_state_dict(SMALL, 9))
    # the file is plain data: torch's safe loader reads it
    payload = torch.load(info.path, weights_only=True)
    assert payload["format"] == FORMAT and payload["config"] == SMALL.to_dict()


def test_loading_into_the_model_is_strict_and_exact(tmp_path: Path) -> None:
    info = save_weights(tmp_path / "w.pt", SMALL, seed=2)
    _, state = read_weights(info.path)
    model = MoETransformer(SMALL)
    load_into(model, state)
    assert _same(model.state_dict(), state)
    with pytest.raises(WeightsError, match="Missing key"):
        load_into(model, {k: v for k, v in state.items() if k != "lm_head"})


def test_expert_shards_split_the_experts_between_ranks() -> None:
    state = generate_state_dict(SMALL, 0)
    halves = [shard_state_dict(state, SMALL, 2, r) for r in range(2)]
    for name in ("layers.0.moe.w_gate", "layers.0.moe.w_up", "layers.0.moe.w_down"):
        assert torch.equal(torch.cat([h[name] for h in halves]), state[name])
        assert halves[1][name].shape[0] == 2
    assert torch.equal(halves[1]["layers.0.moe.router"], state["layers.0.moe.router"])
    with pytest.raises(ValueError, match=r"num_experts \(4\) must be a multiple .* \(3\)"):
        shard_state_dict(state, SMALL, 3, 0)


def test_a_truncated_file_is_refused_with_its_path(tmp_path: Path) -> None:
    path = Path(save_weights(tmp_path / "w.pt", SMALL, seed=1).path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(WeightsError, match=r"cannot read weights file .*w\.pt.*damaged"):
        read_weights(path)


def test_garbage_and_missing_files_are_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file at all")
    with pytest.raises(WeightsError, match="junk.pt"):
        read_weights(junk)
    with pytest.raises(WeightsError, match="does not exist"):
        read_weights(tmp_path / "absent.pt")


def _rewrite(path: Path, change) -> None:  # noqa: ANN001 - a small test helper
    payload = torch.load(path, weights_only=True)
    change(payload)
    torch.save(payload, path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p.update(format="something.else"), "is not a vllm_bridge.moe file"),
        (lambda p: p.update(version=2), "has version 2"),
        (lambda p: p["config"].update(hidden_size=15), "bad model config.*multiple of num_heads"),
        (
            lambda p: p["config"].update(colour="red"),
            r"unknown ModelConfig field\(s\) \['colour'\]",
        ),
        (lambda p: p["state_dict"].pop("norm.weight"), r"lacks tensor\(s\) \['norm.weight'\]"),
        (
            lambda p: p["state_dict"].update(extra=torch.zeros(1)),
            r"unexpected tensor\(s\) \['extra'\]",
        ),
        (
            lambda p: p["state_dict"].update({"lm_head": torch.zeros(16, 31)}),
            r"lm_head has shape \(16, 31\), the config needs \(16, 32\)",
        ),
        (
            lambda p: p["state_dict"].update(
                {"embed.weight": torch.zeros(32, 16, dtype=torch.float16)}
            ),
            "embed.weight has dtype torch.float16, the config needs float32",
        ),
        (lambda p: p.update(seed="x"), "bad seed 'x'"),
    ],
)
def test_a_file_that_does_not_fit_names_what_is_wrong(
    tmp_path: Path, change, message: str  # noqa: ANN001
) -> None:
    path = Path(save_weights(tmp_path / "w.pt", SMALL, seed=1).path)
    _rewrite(path, change)
    with pytest.raises(WeightsError, match=message):
        read_weights(path)


def test_bad_configs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"top_k \(5\) must be <= num_experts \(4\)"):
        ModelConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="dtype must be one of .* got 'int8'"):
        ModelConfig(dtype="int8")
    with pytest.raises(TypeError, match="ModelConfig.hidden_size must be an int"):
        ModelConfig(hidden_size=64.0)
    with pytest.raises(TypeError, match="must be a dict of fields"):
        ModelConfig.from_dict([1, 2])
