"""Where a value sits inside another, as the encoder walks it, for messages: the value
guard's refusals (``the reply to call 7 (at ['items'][2][1])``) and the encoder's
(:mod:`~vllm_bridge.bridge.protocol.foreign`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def find(root: Any, match: Callable[[Any], bool], limit: int) -> tuple[Any, str] | None:
    """The first value inside ``root`` (``root`` itself first) that ``match`` accepts, and
    where it sits as the encoder walks it: list and tuple items, dict keys and values,
    dataclass fields (``"[2]['model'].weight"``, ``"<key 'a'>"`` for a key, ``""`` for
    ``root``); ``None`` when none is found within ``limit`` values. An object met twice is
    looked into once."""
    stack: list[tuple[Any, str]] = [(root, "")]
    seen: set[int] = set()
    while stack and limit > 0:
        value, path = stack.pop()
        limit -= 1
        if match(value):
            return value, path
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            for k, v in reversed(list(value.items())):
                label = repr(k) if isinstance(k, (str, int, float, bool)) else "<key>"
                stack.append((v, f"{path}[{label}]"))
                stack.append((k, f"{path}<key {label}>"))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            stack.extend(
                (getattr(value, f.name, None), f"{path}.{f.name}")
                for f in reversed(dataclasses.fields(value))
            )
    return None
