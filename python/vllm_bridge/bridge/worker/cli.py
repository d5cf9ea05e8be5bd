"""The worker's command line (``python -m vllm_bridge.bridge.worker``): its options,
their bounds, and the line buffering of its stdout and stderr."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.protocol.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_FRAME,
    MIN_MAX_FRAME_BYTES,
)

DEFAULT_MAX_REFS = 10_000
#: Largest ``--poll-us``: 10 ms of polling after a frame is already a lot of CPU.
MAX_POLL_US = 10_000
#: ``--log-level`` names: the root logger's level, and the least a record needs to be
#: sent as a ``log`` frame.
LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of ``python -m vllm_bridge.bridge.worker``."""
    parser = argparse.ArgumentParser(prog="python -m vllm_bridge.bridge.worker")
    parser.add_argument(
        "--allow",
        nargs="+",
        action="extend",
        metavar="MODULE",
        help="modules requests may reach (default: vllm_bridge.PUBLIC_MODULES)",
    )
    parser.add_argument(
        "--also-allow",
        nargs="+",
        action="extend",
        metavar="MODULE",
        help="modules added to that list (one's own modules beside the default ones)",
    )
    parser.add_argument(
        "--max-refs",
        type=int,
        default=DEFAULT_MAX_REFS,
        metavar="N",
        help=f"references this worker may hold at once (default {DEFAULT_MAX_REFS})",
    )
    parser.add_argument(
        "--poll-us",
        type=int,
        default=0,
        metavar="N",
        help="microseconds to poll for the next request before sleeping (default 0: sleep "
        f"at once; at most {MAX_POLL_US})",
    )
    parser.add_argument(
        "--max-frame-bytes",
        type=int,
        default=DEFAULT_MAX_FRAME_BYTES,
        metavar="N",
        help="largest frame body read or written, both ways (default "
        f"{DEFAULT_MAX_FRAME_BYTES}; from {MIN_MAX_FRAME_BYTES} to {MAX_FRAME})",
    )
    parser.add_argument(
        "--log-level",
        choices=sorted(LOG_LEVELS),
        default="warning",
        help="the Python root logger's level; records at or above it are sent to the "
        "Elixir side as log frames (default warning)",
    )
    opts = parser.parse_args(argv)
    if not MIN_MAX_FRAME_BYTES <= opts.max_frame_bytes <= MAX_FRAME:
        parser.error(
            f"--max-frame-bytes must be from {MIN_MAX_FRAME_BYTES} to {MAX_FRAME}, "
            f"got {opts.max_frame_bytes}"
        )
    if not 0 <= opts.poll_us <= MAX_POLL_US:
        parser.error(f"--poll-us must be from 0 to {MAX_POLL_US}, got {opts.poll_us}")
    if opts.max_refs < 1:
        parser.error(f"--max-refs must be at least 1, got {opts.max_refs}")
    for flag, names in (("--allow", opts.allow), ("--also-allow", opts.also_allow)):
        for name in names or ():
            if not all(part.isidentifier() for part in name.split(".")):
                parser.error(f"{flag} {name!r} is not a dotted module name")
    base = opts.allow or PUBLIC_MODULES
    opts.allow = tuple(dict.fromkeys([*base, *(opts.also_allow or ())]))
    return opts


def line_buffered(stream: Any) -> None:
    """Flush `stream` at the end of each line (fds 1 and 2 are pipes read line by line)."""
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None:  # a stream replaced by something else keeps its ways
        reconfigure(line_buffering=True)
