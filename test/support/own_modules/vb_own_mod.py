"""A user's own module for the pool-option tests: found through ``python_path:``."""

import os

__all__ = ["whoami", "env"]


def whoami() -> str:
    """Names this module, so a test sees which copy was imported."""
    return "own module"


def env(name: str) -> str | None:
    """One variable of the worker's environment."""
    return os.environ.get(name)
