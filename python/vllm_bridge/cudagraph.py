"""CUDA-graph modes: what a forward pass may capture or replay.

A *configured* mode (``CompilationConfig.cudagraph_mode``) may name two routines, one for
uniform decode batches and one for mixed prefill/decode batches; a *runtime* mode (the one a
single forward pass runs under, ``ForwardContext.cudagraph_runtime_mode``) is always one of
``NONE``, ``PIECEWISE`` or ``FULL``.

==================== ============== =============
member               decode batches mixed batches
==================== ============== =============
NONE                 NONE           NONE
PIECEWISE            PIECEWISE      PIECEWISE
FULL                 FULL           FULL
FULL_DECODE_ONLY     FULL           NONE
FULL_AND_PIECEWISE   FULL           PIECEWISE
==================== ============== =============

The two-routine members carry a ``(decode, mixed)`` tuple of the plain members' values.
"""

import enum

__all__ = ["CUDAGraphMode", "RUNTIME_MODES", "cudagraph_mode_from"]


class CUDAGraphMode(enum.Enum):
    """CUDA-graph mode; plain members have an int value, two-routine members a tuple."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    # Inside the class body the names above are still their raw int values, so these
    # tuples hold (decode value, mixed value).
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        """True when this mode uses different routines for decode and mixed batches."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> "CUDAGraphMode":
        """The plain mode used for uniform decode batches."""
        if self.separate_routine():
            return CUDAGraphMode(self.value[0])
        return self

    def mixed_mode(self) -> "CUDAGraphMode":
        """The plain mode used for mixed prefill/decode batches."""
        if self.separate_routine():
            return CUDAGraphMode(self.value[1])
        return self

    def has_mode(self, mode: "CUDAGraphMode") -> bool:
        """True when ``mode`` (a plain mode) is used for decode or for mixed batches.

        Raises:
            TypeError: ``mode`` is not a CUDAGraphMode.
            ValueError: ``mode`` is a two-routine mode (only plain modes can be looked up).
        """
        if not isinstance(mode, CUDAGraphMode):
            raise TypeError(f"has_mode expects a CUDAGraphMode, got {mode!r}")
        if mode.separate_routine():
            raise ValueError(
                f"has_mode expects a plain mode (NONE, PIECEWISE or FULL), got {mode.name}"
            )
        if self.separate_routine():
            return mode.value in self.value
        return self is mode

    def requires_piecewise_compilation(self) -> bool:
        """True when some batches run piecewise graphs, so the model must be split."""
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def max_cudagraph_mode(self) -> "CUDAGraphMode":
        """The strongest plain mode this mode uses (FULL > PIECEWISE > NONE)."""
        if self.separate_routine():
            return CUDAGraphMode(max(self.value))
        return self

    def has_full_cudagraphs(self) -> bool:
        """True when some batches run full CUDA graphs."""
        return self.max_cudagraph_mode() is CUDAGraphMode.FULL

    def has_piecewise_cudagraphs(self) -> bool:
        """True when some batches run piecewise CUDA graphs."""
        return self.requires_piecewise_compilation()

    def valid_runtime_modes(self) -> bool:
        """True for the modes a single forward pass may run under: NONE, PIECEWISE, FULL."""
        return self in RUNTIME_MODES

    def __str__(self) -> str:
        return self.name


#: The modes a forward pass can actually run under.
RUNTIME_MODES: frozenset[CUDAGraphMode] = frozenset(
    {CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL}
)


def cudagraph_mode_from(
    value: "CUDAGraphMode | str | int", name: str = "cudagraph mode"
) -> CUDAGraphMode:
    """Coerce ``value`` to a CUDAGraphMode.

    Accepts a member, a member name (case-insensitive, e.g. ``"full_and_piecewise"``; an
    Elixir atom arrives as such a name) or a plain mode's int value (0, 1, 2). ``name``
    (the parameter being converted) is used in error messages.

    Raises:
        ValueError: the name or int names no member.
        TypeError: ``value`` is none of the accepted kinds.
    """
    if isinstance(value, CUDAGraphMode):
        return value
    if isinstance(value, str):
        member = CUDAGraphMode.__members__.get(value.upper())
        if member is None:
            names = ", ".join(CUDAGraphMode.__members__)
            raise ValueError(
                f"{name}: unknown CUDAGraphMode name {value!r}; expected one of {names}"
            )
        return member
    if isinstance(value, int) and not isinstance(value, bool):
        for member in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            if member.value == value:
                return member
        raise ValueError(f"{name}: unknown CUDAGraphMode value {value!r}; expected 0, 1 or 2")
    raise TypeError(f"{name} must be a CUDAGraphMode, a member name or 0/1/2, got {value!r}")
