"""SM control: how many streaming multiprocessors communication and compute kernels may use
while micro-batches overlap (vLLM's ``SMControlContextManager``).

Entering :class:`SMControlContextManager` gives communication ``comm_sms`` SMs and compute
the rest; leaving gives both all of them again (also when the body raised).

**Real setters.** vLLM's are DeepEP's ``set_num_sms`` (its all-to-all kernels) and
DeepGEMM's ``set_num_sms`` (its GEMMs); neither library is used here. torch itself has no
call that limits the SMs of the kernels it launches: NCCL's CTA count is fixed when the
communicator is created (``max_ctas`` in its config), and ``torch.cuda.GreenContext``
(beta) partitions SMs only for work issued on a stream of a green context made up front,
not for kernels already bound to the model's streams. So on this bridge both setters are
no-ops on every platform, and the manager still checks its numbers and keeps the
enter/exit contract, so a real setter can be dropped in.

Applying ``VLLM_DBO_COMM_SMS`` as NCCL's ``max_ctas`` when the DP group is created was
considered and left out: it would be a static limit on every collective of the process
(micro-batched or not, for the group's whole life), not the enter/exit split this
manager promises, and it would need a GPU to test.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import TracebackType

import torch

from vllm_bridge.config import VllmConfig

__all__ = ["DEFAULT_COMM_SMS", "SMControlContextManager", "create_sm_control", "total_sms"]

#: SMs for communication while micro-batches overlap (vLLM's ``VLLM_DBO_COMM_SMS``).
DEFAULT_COMM_SMS = 20


def total_sms(device: torch.device | str | int | None = None) -> int:
    """The device's SM count (``multi_processor_count``).

    Raises:
        ValueError: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise ValueError("SM counts need a CUDA device; none is available (pass total_sms)")
    return torch.cuda.get_device_properties(device).multi_processor_count


class SMControlContextManager:
    """Context manager for controlling SM (Streaming Multiprocessor) allocation.

    Upon entering, it sets the number of SMs for communication to ``comm_sms`` and for
    computation to ``total_sms - comm_sms``; upon exiting (also after an exception) it
    sets both back to ``total_sms``.

    Args:
        comm_sms: SMs for communication (the remainder goes to computation).
        set_comm_sms: Sets the number of SMs for communication.
        set_compute_sms: Sets the number of SMs for computation.
        total_sms: The device's SM count; ``None``: the current CUDA device's.

    Raises:
        ValueError: ``comm_sms`` is negative or not below ``total_sms``, or no SM count.
        TypeError: a setter is not callable, or a count is not an int.
    """

    def __init__(
        self,
        comm_sms: int,
        set_comm_sms: Callable[[int], None],
        set_compute_sms: Callable[[int], None],
        total_sms: int | None = None,
    ) -> None:
        for name, setter in (("set_comm_sms", set_comm_sms), ("set_compute_sms", set_compute_sms)):
            if not callable(setter):
                raise TypeError(f"{name} must be callable, got {setter!r}")
        if total_sms is None:
            total_sms = _current_total_sms()
        for name, value in (("comm_sms", comm_sms), ("total_sms", total_sms)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if total_sms < 1:
            raise ValueError(f"total_sms must be >= 1, got {total_sms}")
        if not 0 <= comm_sms < total_sms:
            raise ValueError(
                f"comm_sms must be >= 0 and < total_sms ({total_sms}), got {comm_sms}"
            )
        self.total_sms = total_sms
        self.compute_sms = total_sms - comm_sms
        self.comm_sms = comm_sms
        self.set_comm_sms = set_comm_sms
        self.set_compute_sms = set_compute_sms

    def __enter__(self) -> None:
        self.set_comm_sms(self.comm_sms)
        self.set_compute_sms(self.compute_sms)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.set_comm_sms(self.total_sms)
        self.set_compute_sms(self.total_sms)


def _current_total_sms() -> int:
    return total_sms(torch.cuda.current_device() if torch.cuda.is_available() else None)


def _no_op(_sms: int) -> None:
    """A setter for hardware or kernels without SM control (see the module docstring)."""


# Without CUDA there are no SMs to split; the wrapper still enters a manager, with these
# numbers, so the code path is the same on every device.
_CPU_TOTAL_SMS = 1


def create_sm_control(vllm_config: VllmConfig, device: torch.device) -> SMControlContextManager:
    """The wrapper's SM control: ``VLLM_DBO_COMM_SMS`` (default 20) SMs for communication
    on CUDA, capped below the device's count; no-op setters (see the module docstring)."""
    if not isinstance(vllm_config, VllmConfig):
        raise TypeError(f"vllm_config must be a VllmConfig, got {vllm_config!r}")
    if torch.device(device).type != "cuda":
        return SMControlContextManager(0, _no_op, _no_op, total_sms=_CPU_TOTAL_SMS)
    raw = os.environ.get("VLLM_DBO_COMM_SMS", str(DEFAULT_COMM_SMS))
    try:
        comm = int(raw)
    except ValueError:
        raise ValueError(f"VLLM_DBO_COMM_SMS must be an int, got {raw!r}") from None
    total = total_sms(device)
    return SMControlContextManager(min(comm, total - 1), _no_op, _no_op, total_sms=total)
