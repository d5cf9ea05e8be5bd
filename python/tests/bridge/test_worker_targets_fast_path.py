"""The one-step fast path of :meth:`TargetResolver.resolve` (a module target whose path is
one name) answers exactly as the general path, :meth:`TargetResolver.walk`: the same
object, or a refusal with the same message, for every name of every module of the
default allow-list and for generated names (private, dunder-free, missing, odd
characters), each asked twice (the guard's cache of passed objects is warm the second
time). bench/results/fast-paths.md ("Fast paths beside general paths") has what the fast
path saves.
"""

from __future__ import annotations

import random
import string
from typing import Any

import pytest

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.protocol.errors import BadArgument
from vllm_bridge.bridge.protocol.messages import ModuleTarget
from vllm_bridge.bridge.worker.targets import TargetResolver


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        obj, where = fn()
    except BadArgument as exc:
        return ("refused", str(exc))
    return ("ok", (id(obj), where))


def _names(module: Any, rng: random.Random) -> list[str]:
    names = [n for n in dir(module) if not n.startswith("__")]
    alphabet = string.ascii_letters + string.digits + "_é"
    generated = [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(60)
    ]
    privates = ["_" + n for n in names[:20]] + ["_", "_x", "x_", "os", "sys", "logger"]
    return names + generated + privates


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_one_step_answers_as_walk(module_name: str) -> None:
    rng = random.Random(f"targets-{module_name}")
    fast = TargetResolver(PUBLIC_MODULES)
    general = TargetResolver(PUBLIC_MODULES)
    module = general.module(module_name)
    seen = {"ok": 0, "refused": 0}
    for name in _names(module, rng):
        target = ModuleTarget(module_name, name)
        for _ in range(2):  # the second time with the guard's cache warm
            got = _outcome(lambda: fast.resolve(target, None, None))  # type: ignore[arg-type]
            want = _outcome(
                lambda: (general.walk(module, name, module_name), f"{module_name}.{name}")
            )
            assert got == want, (module_name, name)
        seen[got[0]] += 1
    assert seen["ok"] > 0 and seen["refused"] > 0, seen
