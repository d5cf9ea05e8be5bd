"""A submodule of a user's package."""

__all__ = ["ping"]


def ping(n: int) -> int:
    """``n + 1``."""
    return n + 1
