"""Input checks shared by the forward-context modules.

Each check raises ``TypeError`` (wrong kind) or ``ValueError`` (wrong value) with a message
that names the parameter and the value it got, so bad input fails where it enters.
"""

from typing import Any

import torch


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) and at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def check_optional_int(name: str, value: Any, *, minimum: int | None = None) -> int | None:
    """Like :func:`check_int`, but ``None`` passes."""
    if value is None:
        return None
    return check_int(name, value, minimum=minimum)


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def check_optional_bool(name: str, value: Any) -> bool | None:
    """Like :func:`check_bool`, but ``None`` passes."""
    if value is None:
        return None
    return check_bool(name, value)


def check_instance(
    name: str, value: Any, cls: type | tuple[type, ...], *, optional: bool = False
) -> Any:
    """Return ``value`` if it is an instance of ``cls`` (or ``None`` when ``optional``)."""
    if (optional and value is None) or isinstance(value, cls):
        return value
    names = cls.__name__ if isinstance(cls, type) else " or ".join(c.__name__ for c in cls)
    article = "an" if names[0] in "AEIOU" else "a"
    suffix = " or None" if optional else ""
    raise TypeError(f"{name} must be {article} {names}{suffix}, got {value!r}")


def check_list_of(name: str, value: Any, cls: type, *, optional: bool = False) -> Any:
    """Return ``value`` if it is a list of ``cls`` instances (or ``None`` when ``optional``)."""
    if (optional and value is None) or (
        isinstance(value, list) and all(isinstance(item, cls) for item in value)
    ):
        return value
    suffix = " or None" if optional else ""
    raise TypeError(f"{name} must be a list of {cls.__name__}{suffix}, got {value!r}")


def is_count_tensor(value: Any) -> bool:
    """Whether ``value`` is a 1-D integer tensor (of token counts)."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 1
        and not value.is_floating_point()
        and not value.is_complex()
    )


def as_count_tensor(name: str, value: Any) -> torch.Tensor:
    """A 1-D CPU integer tensor of token counts from a tensor or a list of ints >= 0."""
    if isinstance(value, torch.Tensor):
        if not is_count_tensor(value):
            raise ValueError(
                f"{name} must be a 1-D integer tensor, got {value.dtype} of shape "
                f"{tuple(value.shape)}"
            )
        return value.cpu()
    if isinstance(value, (list, tuple)):
        for item in value:
            check_int(f"{name} entry", item, minimum=0)
        return torch.tensor(value, dtype=torch.int32)
    raise TypeError(f"{name} must be a tensor or a list of ints, got {value!r}")
