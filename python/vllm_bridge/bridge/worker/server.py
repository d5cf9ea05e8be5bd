"""The worker process: ``python -m vllm_bridge.bridge.worker [--allow MODULE ...]
[--also-allow MODULE ...] [--max-refs N] [--poll-us N] [--max-frame-bytes N]
[--log-level LEVEL]``.

Threads (see :mod:`~vllm_bridge.bridge.worker.executor` for how they share fd 3):

* the main thread is the *execution* thread: it runs requests one at a time
  (:mod:`~vllm_bridge.bridge.worker.dispatch`) and, while idle, reads fd 3 itself. It is the main
  thread because only there can a signal interrupt the running request's code when its
  caller cancels it (:mod:`~vllm_bridge.bridge.worker.interrupt`);
* the *watcher* thread: during a long request it reads fd 3, answers ``ping`` (and
  ``hello``) at once, records ``cancel``\\ s (interrupting the running request) and queues
  requests;
* whichever thread reads a frame decodes and checks it, answers what needs no execution
  and refuses malformed frames (:meth:`Worker.on_frame`);
* the *lifeline* thread (:mod:`~vllm_bridge.bridge.worker.lifeline`) ends the process when
  its parent is gone.

On EOF of fd 3 the queue is dropped and the running request (if any) is interrupted, as a
cancel would; once it is done, every session's contexts are exited and the process exits
with status 0. When the main thread has not got that far within
:data:`EXIT_GRACE_SECONDS` of EOF (a request stuck in C code, or one that swallows the
interruption), the watcher ends the process anyway.
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import sys
import threading
import time
from typing import Any

from vllm_bridge import PROTOCOL_VERSION
from vllm_bridge.bridge.protocol.decoder import Decoder, undecodable
from vllm_bridge.bridge.protocol.encoder import Encoder
from vllm_bridge.bridge.protocol.errors import BadArgument, ProtocolError, safe_str
from vllm_bridge.bridge.protocol.flow import STREAM_WINDOW
from vllm_bridge.bridge.protocol.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameReader,
    enlarge_pipes,
)
from vllm_bridge.bridge.protocol.messages import (
    Abandon,
    Control,
    Invoke,
    Request,
    RequestError,
    parse_request,
    peek_request_id,
)
from vllm_bridge.bridge.protocol.registry import TypeRegistry
from vllm_bridge.bridge.protocol.slot_setup import slot_dir_from_env
from vllm_bridge.bridge.protocol.slots import SlotDir
from vllm_bridge.bridge.worker import allowlist
from vllm_bridge.bridge.worker.channel import Channel, LogFrameHandler

# DEFAULT_MAX_REFS and MAX_POLL_US are imported from here by tests and callers.
from vllm_bridge.bridge.worker.cli import (  # noqa: F401
    DEFAULT_MAX_REFS,
    LOG_LEVELS,
    MAX_POLL_US,
    line_buffered,
    parse_args,
)
from vllm_bridge.bridge.worker.dispatch import Dispatcher
from vllm_bridge.bridge.worker.executor import Executor
from vllm_bridge.bridge.worker.interrupt import Interrupter
from vllm_bridge.bridge.worker.lane import CallLane
from vllm_bridge.bridge.worker.lifeline import watch_parent
from vllm_bridge.bridge.worker import sentinel
from vllm_bridge.bridge.worker.sessions import Sessions
from vllm_bridge.bridge.worker.status import cuda_memory
from vllm_bridge.bridge.worker.stderr import Capture, open_capture, take_back
from vllm_bridge.bridge.worker.targets import TargetResolver

#: Seconds the main thread has, from EOF, to finish the running request and exit the
#: sessions' contexts before the watcher exits the process regardless.
EXIT_GRACE_SECONDS = 2.0
CAPABILITIES = ("stream", "context", "cancel", "credit", "refs", "log")
_log = logging.getLogger("vllm_bridge.bridge.worker")


def _import_allowed(modules: tuple[str, ...]) -> dict[str, str]:
    """Import every allow-listed module; the ones that fail, with why (also logged)."""
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # announced in the hello, and named again by each call
            failed[name] = f"{type(exc).__name__}: {exc}"
            _log.info("allow-listed module %s failed to import: %s", name, failed[name])
    return failed


def hello_device() -> str:
    """The device this worker computes on, for the hello, without initialising CUDA.

    ``"cuda:N"`` when CUDA is usable, else ``"cpu"``, as
    :func:`vllm_bridge.bridge.diag.default_device` says, but when nothing has initialised CUDA yet
    it does not ask CUDA for its current device: ``torch.cuda.current_device()`` runs
    torch's lazy CUDA initialisation, work that would delay the handshake for a name.
    Until code picks another device, CUDA's current device is 0; so the answer is
    ``"cuda:0"``, and the first request that uses the GPU initialises CUDA.
    """
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    if torch.cuda.is_initialized():
        return f"cuda:{torch.cuda.current_device()}"
    return "cuda:0"


def _hello(
    instance: str,
    modules: tuple[str, ...],
    import_errors: dict[str, str],
    max_frame: int,
    slots: SlotDir | None = None,
) -> list[Any]:
    import torch

    return [
        "hello",
        {
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "device": hello_device(),
            "instance": instance,
            "stream_window": STREAM_WINDOW,
            "max_frame_bytes": max_frame,
            "capabilities": list(CAPABILITIES),
            "modules": list(modules),
            "import_errors": import_errors,
            # The slot directory this worker opened (path and inode), or None: the Elixir
            # side sends slot names only to workers that read its own.
            "shm": slots.identity() if slots is not None else None,
        },
    ]


class Worker:
    """One worker process: the reader loop and everything it feeds."""

    def __init__(
        self,
        modules: tuple[str, ...],
        max_refs: int,
        poll_us: int = 0,
        import_errors: dict[str, str] | None = None,
        max_frame: int = DEFAULT_MAX_FRAME_BYTES,
        log_level: int = logging.WARNING,
        lane: bool = True,
        hold: bool = True,
    ) -> None:
        """``lane``: run the common call through :mod:`~vllm_bridge.bridge.worker.lane`
        (off: every request takes the general path; the lane's test compares the two).
        ``hold``: a reply made while the next request is already read goes out with the
        next write (:meth:`~vllm_bridge.bridge.worker.channel.Channel.hold`; off: each
        reply is written at once)."""
        self.modules = modules
        self.log_level = log_level
        self.max_frame = max_frame
        self.import_errors = dict(import_errors or {})
        self.instance = secrets.token_hex(8)
        self.registry = TypeRegistry(modules)
        # Large tensors through shared memory when the BEAM gave a slot directory.
        self.slots = slot_dir_from_env()
        self.decoder = Decoder(self.slots)
        self.channel = Channel(Encoder(self.registry, slots=self.slots), max_frame=max_frame)
        self.sessions = Sessions(self.instance, max_refs)
        self.interrupter = Interrupter()
        self.dispatcher = Dispatcher(
            self.sessions,
            TargetResolver(modules),
            self.registry,
            self.channel,
            # The executor is made next, with the dispatcher's entry points.
            lambda request: self.executor.open_flow(request),
            self.interrupter,
        )
        self.lane = CallLane(self, self.dispatcher, self.decoder) if lane else None
        self.executor = Executor(
            self.dispatcher.handle if self.lane is None else self.lane.handle,
            self.dispatcher.refuse,
            self.channel.write,
            self.on_frame,
            FrameReader(poll_s=poll_us / 1e6, max_frame=max_frame),
            # The port is gone: replies and log frames have no reader any more.
            on_eof=self.channel.close,
            interrupt=self.interrupter.interrupt,
            failed=self.dispatcher.failed,
            own_frame=None if self.lane is None else self.lane.on_frame,
            hold=self.channel.hold if hold else None,
            flush=self.channel.flush,
            ended=self.sessions.release_locals,
            unhandled=self._not_handled,
        )
        self.interrupter.again = self.executor.interrupt_again

    def serve(self, capture: Capture | None = None) -> int:
        """Announce, then serve on this thread (the main thread) until EOF; returns the
        exit status. ``capture``: the start-up stderr (:mod:`.stderr`), given back to the
        real stderr just before the hello goes out."""
        watch_parent()
        self.interrupter.install()
        # Before the hello, not after: once Elixir has the hello, the pool may be serving
        # and anyone may look at (or write through) this process's fd 2.
        take_back(capture)
        self.channel.send(
            _hello(self.instance, self.modules, self.import_errors, self.max_frame, self.slots)
        )
        root = logging.getLogger()
        for handler in root.handlers:
            # While the port is open records go to the Elixir side as log frames; stderr
            # gets them only before the handshake and after EOF.
            handler.addFilter(lambda _record: self.channel.closed)
        # The handler's own level too: a logger of its own level (a library's, set to
        # debug) hands its records to the root's handlers whatever the root's level.
        root.addHandler(_HeldLogFrameHandler(self.channel, self.interrupter, self.log_level))
        threading.Thread(target=self._watch, name="vllm-bridge-watch", daemon=True).start()
        self.executor.run(final=self._close_sessions)
        if self.slots is not None:
            self.slots.close()  # (a worker killed instead: the BEAM's sweep deletes them)
        return 0

    def _watch(self) -> None:
        # The watcher thread. Once the input has ended (the executor has dropped the queue
        # and interrupted the running request), the main thread has EXIT_GRACE_SECONDS to
        # finish that request and exit the sessions' contexts; then the process exits.
        self.executor.watch()
        if not self.executor.done.wait(EXIT_GRACE_SECONDS):
            sys.stderr.write(
                f"vllm_bridge.bridge.worker {os.getpid()}: fd 3 closed while request "
                f"{self.executor.running_id} runs (it did not stop when interrupted); "
                f"exiting after {EXIT_GRACE_SECONDS} s without waiting for it\n"
            )
            sys.stderr.flush()
            os._exit(0)

    def on_frame(self, body: bytes | bytearray | memoryview) -> Request | None:
        """Handle one frame on the thread that read it: the request to run, or ``None``
        when the frame was answered here (a control message, a refusal)."""
        try:
            now = time.monotonic()
            try:
                decoded = self.decoder.decode(body)
            except (BadArgument, ProtocolError) as exc:
                # Read from the first bytes alone: every request whose header is readable
                # is answered under its id, whatever its values hold.
                self.channel.error(peek_request_id(body), exc.error_type, str(exc))
                return None
        except Exception as exc:  # a last guard: reading must go on
            return self._not_handled(body, exc)
        return self.on_value(body, decoded.value, decoded.special, now)

    def undecodable(self, body: bytes | bytearray | memoryview, exc: Exception) -> None:
        """Refuse ``body``, whose decoding failed with ``exc``, as :meth:`on_frame` does
        (the lane's decoding: :mod:`~vllm_bridge.bridge.worker.lane`)."""
        try:
            refusal = undecodable(body, exc)
            self.channel.error(peek_request_id(body), refusal.error_type, str(refusal))
        except Exception as failed:  # a last guard: reading must go on
            self._not_handled(body, failed)

    def on_value(
        self, body: bytes | bytearray | memoryview, value: Any, special: bool, now: float
    ) -> Request | None:
        """:meth:`on_frame` once ``body`` is decoded to ``value`` (``special``: as
        :attr:`Decoded.special`), received at ``now`` (``time.monotonic()``)."""
        try:
            try:
                req = parse_request(value, now)
            except RequestError as exc:
                self.channel.error(exc.request_id, "protocol", str(exc))
                return None
            if isinstance(req, Control):
                return self._control(req)
            if special and isinstance(req, Invoke):
                req.special = True
            return req
        except Exception as exc:  # a last guard: reading must go on
            return self._not_handled(body, exc)

    def _not_handled(self, body: bytes | bytearray | memoryview, exc: Exception) -> None:
        _log.exception("frame of %d bytes could not be handled", len(body), exc_info=exc)
        self.channel.error(
            peek_request_id(body), "protocol", f"frame not handled: {safe_str(exc):.2000}"
        )

    def _control(self, req: Control) -> Request | None:
        if req.kind == "ping":
            status = {
                "running": self.executor.running_id,
                "running_for": self.executor.running_for,
                "queued": self.executor.queued,
                "sessions": len(self.sessions),
                "refs": self.sessions.ref_count,
                "cuda": cuda_memory(),
            }
            self.channel.send(["pong", req.id, status])
        elif req.kind == "cancel":
            dropped: Request | None = self.executor.cancel(req.id)
            if dropped is not None:
                message = f"{dropped.kind} {dropped.id} was cancelled before it started"
                self.channel.error(dropped.id, "cancelled", message)
            else:
                # Running (marked) or already finished: if it is an enter, the context it
                # entered is exited in turn, before anything that arrived after this
                # cancel; also when the mark came too late for the enter to see it.
                return Abandon("abandon", req.id, None, None)
        elif req.kind == "credit":
            self.executor.grant(req.id, req.info["n"])
        elif req.kind == "hello":
            version = (req.info or {}).get("protocol")
            if version == PROTOCOL_VERSION:
                self.channel.send(["ok", req.id, {"protocol": PROTOCOL_VERSION}])
            else:
                self.channel.error(
                    req.id,
                    "protocol",
                    f"protocol version {version!r} is not spoken by this worker, which "
                    f"speaks version {PROTOCOL_VERSION}",
                )
        return None

    def _close_sessions(self) -> None:
        # Last thing the execution thread does, once the stream has ended. Only worth a
        # line when contexts were still entered (a routine shutdown stays quiet).
        sessions, contexts = self.dispatcher.close_all()
        if contexts:
            sys.stderr.write(
                f"vllm_bridge.bridge.worker {os.getpid()}: fd 3 closed; exited {contexts} contexts "
                f"of {sessions} sessions\n"
            )


class _HeldLogFrameHandler(LogFrameHandler):
    """Log frames that an interruption of the running request cannot cut in half: the
    request's code may log, and a frame left half-written would end the stream."""

    def __init__(self, channel: Channel, interrupter: Interrupter, level: int) -> None:
        super().__init__(channel, level)
        self._interrupter = interrupter

    def emit(self, record: logging.LogRecord) -> None:
        with self._interrupter.held():
            super().emit(record)


def main(argv: list[str] | None = None) -> int:
    """Run a worker on fds 3 and 4 until fd 3 reaches EOF."""
    # First: the start-up stderr file may be deleted as soon as the hello arrives.
    capture = open_capture()
    opts = parse_args(argv)
    # From the main thread: the sentinel's PR_SET_PDEATHSIG follows the thread that
    # started it, and this one ends only with the interpreter.
    spawned = sentinel.spawn()
    # Before any request: code running in the worker (introspection) reads it from there.
    allowlist.publish(opts.allow)
    # fd 1 is a pipe (the Elixir side logs what arrives line by line): a print must go
    # out when its line ends, not when a block fills or the process exits.
    line_buffered(sys.stdout)
    line_buffered(sys.stderr)
    log_level = LOG_LEVELS[opts.log_level]
    logging.basicConfig(
        stream=sys.stderr,
        level=log_level,
        format="%(asctime)s %(levelname)s %(name)s [worker %(process)d] %(message)s",
    )
    logging.captureWarnings(True)
    enlarge_pipes()
    import_errors = _import_allowed(opts.allow)
    worker = Worker(
        opts.allow, opts.max_refs, opts.poll_us, import_errors, opts.max_frame_bytes, log_level
    )
    if spawned is not None:
        spawned.confirm()  # armed by now, or said why not: before the pool may serve
    return worker.serve(capture)
