"""The worker's start-up stderr, and taking the real one back after the handshake.

The Elixir launcher starts the worker with fd 2 on a private file and its real stderr (a
FIFO the Elixir side reads and logs line by line) on another fd
(``VLLM_BRIDGE_STDERR_FD``), naming the file in ``VLLM_BRIDGE_STDERR_FILE``
(docs/PROTOCOL.md, "Start-up stderr"): when the start fails, the Elixir side puts the
file's last lines into its error instead of the console showing the same traceback once
per attempt. Just before the hello is sent, :func:`take_back` puts the real stderr back on fd 2
and copies there what the file holds (warnings of the imports, say), so nothing written
before the handshake is lost; the Elixir side deletes the file when the hello arrives.

:func:`open_capture` must run before the hello is sent (the file may be deleted as soon as
the hello arrives): it opens the file for reading, which keeps its content reachable.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

FILE_ENV = "VLLM_BRIDGE_STDERR_FILE"
FD_ENV = "VLLM_BRIDGE_STDERR_FD"


@dataclass
class Capture:
    """A start-up stderr capture: the real stderr's fd, and the file open for reading."""

    real_fd: int
    read_fd: int | None


def open_capture(environ: dict[str, str] | None = None) -> Capture | None:
    """The capture the launcher set up, or ``None`` when it set none up.

    The two variables are taken out of the environment, so that processes this worker
    starts do not inherit them (nor the real stderr's fd, made non-inheritable).

    Raises:
        ValueError: ``VLLM_BRIDGE_STDERR_FD`` is not a file descriptor number.
    """
    env = os.environ if environ is None else environ
    path = env.pop(FILE_ENV, None)
    fd_text = env.pop(FD_ENV, None)
    if fd_text is None:
        return None
    if not fd_text.isdigit() or int(fd_text) <= 2:
        raise ValueError(f"{FD_ENV} must be a file descriptor above 2, got {fd_text!r}")
    real_fd = int(fd_text)
    os.set_inheritable(real_fd, False)
    read_fd = None
    if path:
        try:
            read_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            # Nothing to copy later; said where it will be seen (fd 2 is the file's).
            note = f"vllm_bridge worker: cannot read its start-up stderr: {exc}\n"
            _write_all(real_fd, note.encode())
    return Capture(real_fd, read_fd)


def take_back(capture: Capture | None) -> None:
    """Puts the real stderr back on fd 2, then copies what the start-up file holds to it.

    fd 2 is switched first, so nothing any thread writes is lost; a write racing the copy
    may come out before the start-up lines it follows. The copy is best effort: it runs
    just before the hello, so a real stderr that is broken (a closed pipe) must not end
    the worker's start; it stops the copy instead.
    """
    if capture is None:
        return
    sys.stderr.flush()
    os.dup2(capture.real_fd, 2)
    os.close(capture.real_fd)
    if capture.read_fd is None:
        return
    try:
        while chunk := os.read(capture.read_fd, 65536):
            _write_all(2, chunk)
    except OSError:
        pass  # nowhere to copy to: what stderr cannot show, it cannot show
    finally:
        os.close(capture.read_fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
