"""What the one-step fast path of TargetResolver.resolve saves (issue 14): a module
target of one name (the common case, every generated binding's) resolved by the fast
path against the general path, TargetResolver.walk, in alternating rounds of the same
run; median of 9 rounds. Run: .venv/bin/python bench/targets_fast_path.py
"""

from __future__ import annotations

import statistics
import time

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.protocol.messages import ModuleTarget
from vllm_bridge.bridge.worker.targets import TargetResolver

N = 100_000


def per_call_us(fn) -> float:
    start = time.perf_counter()
    for _ in range(N):
        fn()
    return (time.perf_counter() - start) / N * 1e6


def main() -> None:
    r = TargetResolver(PUBLIC_MODULES)
    for module, name in [
        ("vllm_bridge.forward_context", "is_forward_context_available"),
        ("vllm_bridge.dp", "coordinate_batch_across_dp"),
    ]:
        target = ModuleTarget(module, name)

        def fast() -> None:
            r.resolve(target, None, None)  # type: ignore[arg-type]

        def general() -> None:
            r.walk(r.module(module), name, module)

        fast()
        general()
        fasts, generals = [], []
        for _ in range(9):
            fasts.append(per_call_us(fast))
            generals.append(per_call_us(general))
        f, g = statistics.median(fasts), statistics.median(generals)
        print(f"{module}.{name:32} fast {f:6.3f} us  general {g:6.3f} us  saved {g - f:6.3f} us")


if __name__ == "__main__":
    main()
