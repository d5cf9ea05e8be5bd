"""The compute platform a forward pass runs on: CPU or CUDA.

``current_platform`` answers the two questions the forward context asks of a platform:
how to wait for the device (``synchronize``; ``None`` on CPU, where there is nothing to
wait for) and which extra fields a forward context gets (none on either platform here).
"""

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["Platform", "current_platform", "detect_platform"]


def _cuda_synchronize() -> None:
    """Wait for the current CUDA device, if this process has started using CUDA."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Platform:
    """A compute platform.

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"``.
        synchronize: Waits for queued device work to finish; ``None`` when the platform
            runs synchronously (CPU).
    """

    device_type: str
    synchronize: Callable[[], None] | None

    def set_additional_forward_context(self, **kwargs: Any) -> dict[str, Any]:
        """Extra entries for ``ForwardContext.additional_kwargs``; none on CPU or CUDA."""
        return {}


def rank_device(rank: int) -> str:
    """The GPU of DP rank ``rank`` when several ranks share a host: ``cuda:<rank mod the
    GPU count>`` (the model and the group's NCCL collectives both use it). Needs CUDA."""
    return f"cuda:{rank % torch.cuda.device_count()}"


def detect_platform() -> Platform:
    """The platform of this process: CUDA when a CUDA device is usable, else CPU."""
    if torch.cuda.is_available():
        return Platform(device_type="cuda", synchronize=_cuda_synchronize)
    return Platform(device_type="cpu", synchronize=None)


#: The platform detected when this module was imported.
current_platform: Platform = detect_platform()
