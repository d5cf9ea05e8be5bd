"""CUDAGraphMode: members, the two-routine split and the dispatcher helpers."""

import pytest

from vllm_bridge.cudagraph import CUDAGraphMode, cudagraph_mode_from

M = CUDAGraphMode


def test_plain_member_values() -> None:
    assert [M.NONE.value, M.PIECEWISE.value, M.FULL.value] == [0, 1, 2]


def test_two_routine_members_hold_decode_then_mixed_values() -> None:
    assert M.FULL_DECODE_ONLY.value == (2, 0)
    assert M.FULL_AND_PIECEWISE.value == (2, 1)


@pytest.mark.parametrize(
    "mode, decode, mixed",
    [
        (M.NONE, M.NONE, M.NONE),
        (M.PIECEWISE, M.PIECEWISE, M.PIECEWISE),
        (M.FULL, M.FULL, M.FULL),
        (M.FULL_DECODE_ONLY, M.FULL, M.NONE),
        (M.FULL_AND_PIECEWISE, M.FULL, M.PIECEWISE),
    ],
)
def test_decode_and_mixed_modes(mode: M, decode: M, mixed: M) -> None:
    assert mode.decode_mode() is decode
    assert mode.mixed_mode() is mixed
    assert mode.separate_routine() == (decode is not mixed)


@pytest.mark.parametrize(
    "mode, has_none, has_piecewise, has_full",
    [
        (M.NONE, True, False, False),
        (M.PIECEWISE, False, True, False),
        (M.FULL, False, False, True),
        (M.FULL_DECODE_ONLY, True, False, True),
        (M.FULL_AND_PIECEWISE, False, True, True),
    ],
)
def test_has_mode_and_derived_checks(
    mode: M, has_none: bool, has_piecewise: bool, has_full: bool
) -> None:
    assert mode.has_mode(M.NONE) is has_none
    assert mode.has_mode(M.PIECEWISE) is has_piecewise
    assert mode.has_mode(M.FULL) is has_full
    assert mode.has_full_cudagraphs() is has_full
    assert mode.has_piecewise_cudagraphs() is has_piecewise
    assert mode.requires_piecewise_compilation() is has_piecewise


@pytest.mark.parametrize(
    "mode, top",
    [
        (M.NONE, M.NONE),
        (M.PIECEWISE, M.PIECEWISE),
        (M.FULL, M.FULL),
        (M.FULL_DECODE_ONLY, M.FULL),
        (M.FULL_AND_PIECEWISE, M.FULL),
    ],
)
def test_max_cudagraph_mode(mode: M, top: M) -> None:
    assert mode.max_cudagraph_mode() is top


def test_valid_runtime_modes_are_exactly_the_plain_ones() -> None:
    valid = {m for m in M if m.valid_runtime_modes()}
    assert valid == {M.NONE, M.PIECEWISE, M.FULL}


def test_has_mode_refuses_two_routine_or_foreign_arguments() -> None:
    with pytest.raises(ValueError, match="FULL_AND_PIECEWISE"):
        M.FULL.has_mode(M.FULL_AND_PIECEWISE)
    with pytest.raises(TypeError, match="'FULL'"):
        M.FULL.has_mode("FULL")  # type: ignore[arg-type]


def test_str_is_the_member_name() -> None:
    assert str(M.FULL_DECODE_ONLY) == "FULL_DECODE_ONLY"


def test_cudagraph_mode_from_names_ints_and_members() -> None:
    assert cudagraph_mode_from("full_and_piecewise") is M.FULL_AND_PIECEWISE
    assert cudagraph_mode_from("PIECEWISE") is M.PIECEWISE
    assert cudagraph_mode_from(2) is M.FULL
    assert cudagraph_mode_from(M.NONE) is M.NONE
    with pytest.raises(ValueError, match="'fastest'"):
        cudagraph_mode_from("fastest")
    with pytest.raises(ValueError, match="7"):
        cudagraph_mode_from(7)
    with pytest.raises(TypeError, match="True"):
        cudagraph_mode_from(True)  # type: ignore[arg-type]
