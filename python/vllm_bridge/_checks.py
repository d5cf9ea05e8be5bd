"""Input checks shared by the forward-context modules.

Each check raises ``TypeError`` (wrong kind) or ``ValueError`` (wrong value) with a message
that names the parameter and the value it got, so bad input fails where it enters.
"""

from typing import Any


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
