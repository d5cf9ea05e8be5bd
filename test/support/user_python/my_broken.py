"""A user's module that fails to import (the generator names its error)."""

raise RuntimeError("my_broken fails on purpose")
