"""Tensors in slots (ext 8): large tensors through shared memory instead of the pipe.

The Elixir side makes one directory per BEAM (mode 0700, on ``/dev/shm``) and gives it to
its workers in ``VLLM_BRIDGE_SHM_DIR``. A slot is a plain file there, named by its writer:
``e-<n>`` for arguments (written by Elixir callers, read here), ``r-<pid>-<n>`` for this
worker's results (written here, read by Elixir). A reader that is done with a slot hands
it back by renaming it ``<name>.free``; its writer takes it again by renaming it, so a
slot keeps its pages (an argument slot back to its name; a result slot to a new name, so
that a name is lent once: see :meth:`SlotDir._take`). An argument arrives without a copy: its tensor maps the slot
privately, and the slot is held (``<name>.held-<pid>``) until the tensor is gone. A
result slot handed back (or given back) and unused for ``IDLE_AFTER_S`` is deleted (a
thread runs while there are any); a lent one is never deleted by that thread, since its
frame may be decoded late (a stream chunk its consumer pulls minutes later).

A frame names a slot, never a path: a name that is not of the pattern of what this side
reads is refused; the file is opened relative to the directory with ``O_NOFOLLOW`` and
must be a regular file of this process's uid whose size is the tensor's
(docs/PROTOCOL.md, "Tensors in slots (ext 8)"; docs/SECURITY.md).

The ext 8 payload: ext 3's header (dtype code, ndim, device length and name, the shape as
big-endian u64s), then the slot's name (u8 length, ASCII).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import stat
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_bridge.bridge.protocol.errors import BadArgument

#: Tensors of at least this many bytes go into a slot (``VLLM_BRIDGE_SHM_MIN_BYTES``).
DEFAULT_MIN_BYTES = 1024 * 1024
#: Result slots a worker keeps at most (lent and free): past it a result takes the pipe.
MAX_RESULT_SLOTS = 4
#: A result slot lent this long without being handed back may be lost (its frame was
#: never decoded by a caller that is still alive; the Elixir side hands back the slots of
#: a frame whose caller died before decoding it): when a result needs a slot and every
#: one is lent, the one lent longest is deleted if lent this long, and a new one (a new
#: name) made instead. Only then: a slot lent this long may still be read (a stream
#: chunk waits undecoded until its consumer pulls it).
#: (``VLLM_BRIDGE_SHM_RECLAIM_S`` sets it for a worker: the tests' short ages.)
RECLAIM_AFTER_S = 30.0
#: A result slot unused this long (handed back and not written since) is deleted, so
#: that a worker that once returned a large result does not keep its pages for ever; a
#: worker that returns large results back to back keeps reusing its slots.
#: (``VLLM_BRIDGE_SHM_IDLE_S`` sets it for a worker.)
IDLE_AFTER_S = 5.0

#: The largest age the environment may set (a day): a timed wait of half of it stays far
#: inside what the platform's timers take (``threading.TIMEOUT_MAX``).
MAX_AGE_S = 86_400.0

_log = logging.getLogger(__name__)

_ARG_NAME = re.compile(r"e-[0-9]{1,20}")


def slot_payload(header: bytes, name: str) -> bytes:
    """The ext 8 payload of a tensor whose ext 3 header is ``header``, in slot ``name``."""
    raw = name.encode("ascii")
    return header + bytes((len(raw),)) + raw


def split_payload(payload: bytes | memoryview) -> tuple[bytes, str]:
    """``(ext 3 header, slot name)`` of an ext 8 payload.

    Raises:
        BadArgument: a truncated payload, or a name that is not ASCII.
    """
    data = bytes(payload)
    if len(data) < 3:
        raise BadArgument(f"tensor-in-a-slot (ext 8) payload of {len(data)} bytes is truncated")
    head = 3 + data[2] + 8 * data[1]
    if len(data) < head + 1 or len(data) != head + 1 + data[head]:
        raise BadArgument(
            f"malformed tensor-in-a-slot (ext 8) payload of {len(data)} bytes"
        )
    try:
        name = data[head + 1 :].decode("ascii")
    except UnicodeDecodeError:
        raise BadArgument(f"tensor slot name {data[head + 1:]!r} is not ASCII") from None
    return data[:head], name


@dataclass
class _Slot:
    name: str
    size: int = 0
    lent: bool = False
    mapping: mmap.mmap | None = None
    #: When it was last lent out, or made (time.monotonic()): its idle time counts from
    #: there (:meth:`SlotDir.expire`).
    lent_at: float = 0.0


@dataclass
class SlotDir:
    """The slot directory of this worker's BEAM: reads argument slots, writes result slots."""

    path: str
    fd: int
    min_bytes: int = DEFAULT_MIN_BYTES
    max_slots: int = MAX_RESULT_SLOTS
    reclaim_after_s: float = RECLAIM_AFTER_S
    idle_after_s: float = IDLE_AFTER_S
    #: Whether a thread calls :meth:`expire` while there are result slots (the tests of
    #: the bookkeeping call it themselves, with the time they choose).
    sweep: bool = True
    _said_full: bool = False
    _slots: list[_Slot] = field(default_factory=list)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: The thread that deletes idle result slots, while there are any (`_expire_loop`).
    _sweeper: threading.Thread | None = None
    _closed: threading.Event = field(default_factory=threading.Event)

    # -- arguments: read ------------------------------------------------------------------

    def read(self, name: str, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` of argument slot ``name`` as a uint8 tensor that maps the slot
        privately (no copy: pages are read where they lie, and a write to the tensor
        copies only the page it touches, never changing the file).

        While the tensor lives the slot is this process's: renamed
        ``name.held-<pid>``; once the tensor (and every view of it) is gone, the slot is
        handed back (renamed ``name.free``). A worker that dies holding it: the BEAM's
        sweep deletes it.

        Raises:
            BadArgument: ``name`` is not an argument slot's (``e-<n>``), or the file is
                missing, a link, not a regular file of this uid, or not ``nbytes`` long.
        """
        if not _ARG_NAME.fullmatch(name):
            raise BadArgument(
                f"the tensor slot {name!r} is not the name of an argument slot (e-<n>)"
            )
        try:
            # (O_NONBLOCK: a FIFO planted there must not block the open; it is refused.)
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            fd = os.open(name, flags, dir_fd=self.fd)
        except FileNotFoundError:
            raise BadArgument(f"the tensor slot {name!r} is gone (its caller gave up)") from None
        except OSError as exc:
            raise BadArgument(
                f"the tensor slot {name!r} cannot be opened: {exc.strerror}"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadArgument(f"the tensor slot {name!r} is not a regular file")
            if st.st_uid != os.geteuid():
                raise BadArgument(
                    f"the tensor slot {name!r} belongs to uid {st.st_uid}, not {os.geteuid()}"
                )
            if st.st_size != nbytes:
                raise BadArgument(
                    f"the tensor slot {name!r} holds {st.st_size} bytes, the tensor needs {nbytes}"
                )
            if nbytes == 0:
                self._rename(name, name + ".free")
                return torch.empty(0, dtype=torch.uint8)
            m = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self._rename(name, name + ".free")  # refused: its writer may have it back
            raise
        os.close(fd)
        held = f"{name}.held-{os.getpid()}"
        self._rename(name, held)
        weakref.finalize(m, self._rename, held, name + ".free")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(m, dtype=torch.uint8)

    def _rename(self, src: str, dst: str) -> None:
        try:
            os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError:
            pass  # deleted meanwhile (its caller gave up), or the directory is closed

    # -- results: write -------------------------------------------------------------------

    def write(self, data: memoryview) -> str | None:
        """Writes ``data`` into a free result slot of this worker and lends it out: its
        name, or None when every slot is lent (the tensor then takes the pipe)."""
        with self._lock:
            slot = self._take()
            if slot is None:
                return None
            n = data.nbytes
            try:
                if slot.size != n or slot.mapping is None:
                    self._resize(slot, n)
                if slot.mapping is not None:  # (None only for an empty tensor)
                    slot.mapping[:n] = data
            except OSError:
                self._drop(slot)
                return None
            slot.lent = True
            slot.lent_at = time.monotonic()
            return slot.name

    def give_back(self, name: str) -> None:
        """A result slot written for a frame that was not sent: free again."""
        with self._lock:
            for slot in self._slots:
                if slot.name == name:
                    slot.lent = False

    def _take_back(self, free: str) -> str | None:
        """The handed-back slot ``free`` under a fresh name, or None (not handed back).

        A link, then the unlink of ``free``, not a rename: a rename would replace a file
        that has the fresh name already (a slot a dead process of the same os pid left,
        which a caller may still hold a frame of), a link refuses to (``EEXIST``: the
        next name is tried)."""
        for _ in range(8):
            fresh = self._new_name()
            try:
                os.link(free, fresh, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            except FileExistsError:
                continue
            except OSError:
                return None
            try:
                os.unlink(free, dir_fd=self.fd)
            except OSError:
                pass  # (gone meanwhile: the fresh name holds the file all the same)
            return fresh
        return None

    def _take(self) -> _Slot | None:
        for slot in self._slots:
            if not slot.lent:
                return slot
        for slot in self._slots:
            # Taken again under a new name (the same file, its pages kept): a name is lent
            # once, so a frame's name can never come to mean a later lend of its file.
            # The Elixir side relies on it: it hands back the slots of a frame whose
            # caller died unread by renaming the frame's names `.free`, which must not
            # touch the file once it has been handed back and lent again.
            fresh = self._take_back(slot.name + ".free")
            if fresh is None:
                continue
            slot.name = fresh
            slot.lent = False
            return slot
        if len(self._slots) >= self.max_slots and not self._reclaim():
            if not self._said_full:
                self._said_full = True
                _log.warning(
                    "every result slot of this worker is lent (%d): large results take the "
                    "pipe until one is handed back or reclaimed after %g s",
                    self.max_slots,
                    self.reclaim_after_s,
                )
            return None
        for _ in range(8):
            # (A name a dead process of the same os pid left is passed over, not reused.)
            name = self._new_name()
            try:
                fd = os.open(
                    name,
                    os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=self.fd,
                )
                break
            except FileExistsError:
                continue
            except OSError:
                return None
        else:
            return None
        os.close(fd)
        slot = _Slot(name, lent_at=time.monotonic())
        self._slots.append(slot)
        if self.sweep and self._sweeper is None and not self._closed.is_set():
            self._sweeper = threading.Thread(
                target=self._expire_loop, name="vllm-bridge-slots", daemon=True
            )
            self._sweeper.start()
        return slot

    def _new_name(self) -> str:
        """A result slot name never used before by this process (``r-<pid>-<n>``)."""
        name = f"r-{os.getpid()}-{self._next}"
        self._next += 1
        return name

    # -- results: idle slots deleted --------------------------------------------------------

    def expire(self, now: float | None = None) -> list[str]:
        """Deletes the free result slots unused for ``idle_after_s`` at ``now`` (default:
        the monotonic clock): handed back by their reader, or given back, and not written
        since. A lent slot is kept however long it was lent: its frame may still be
        decoded (a stream chunk is decoded when its consumer pulls it, which may be long
        after it was sent), and deleting it would lose that chunk. A lent slot whose frame
        is never decoded is ``_reclaim``'s, when a result needs its room. The names
        deleted are never used again. Returns them."""
        now = time.monotonic() if now is None else now
        gone: list[str] = []
        with self._lock:
            for slot in list(self._slots):
                free = not slot.lent or self._handed_back(slot)
                if free and now - slot.lent_at >= self.idle_after_s:
                    self._drop(slot)
                    gone.append(slot.name)
        return gone

    def _handed_back(self, slot: _Slot) -> bool:
        try:
            os.stat(slot.name + ".free", dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return False
        return True

    def _expire_loop(self) -> None:
        """Runs ``expire`` every half idle period while this worker has result slots; ends
        (and is started again with the next slot) when it has none, or at ``close``."""
        period = min(max(0.05, self.idle_after_s / 2), MAX_AGE_S)
        try:
            while not self._closed.wait(period):
                self.expire()
                with self._lock:
                    if not self._slots:
                        return
        finally:
            # Also when the loop died of an error: the next slot starts a sweeper again.
            with self._lock:
                if self._sweeper is threading.current_thread():
                    self._sweeper = None

    def _reclaim(self) -> bool:
        """Drops the slot lent longest, if past the reclaim age (its reader is taken to be
        gone): True when one was dropped. Its name is never used again, so a reader that
        comes late finds it gone, never another result's data."""
        now = time.monotonic()
        lent = [s for s in self._slots if s.lent and now - s.lent_at >= self.reclaim_after_s]
        if not lent:
            return False
        self._drop(min(lent, key=lambda s: s.lent_at))
        return True

    def _resize(self, slot: _Slot, n: int) -> None:
        if slot.mapping is not None:
            slot.mapping.close()
            slot.mapping = None
        fd = os.open(slot.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            os.ftruncate(fd, n)
            # Its pages now, not at the first write through the mapping: a full /dev/shm
            # is an OSError here (the tensor takes the pipe), not a SIGBUS there.
            if n:
                os.posix_fallocate(fd, 0, n)
            slot.size = n
            if n:
                prot = mmap.PROT_READ | mmap.PROT_WRITE
                slot.mapping = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)

    def _drop(self, slot: _Slot) -> None:
        if slot.mapping is not None:
            slot.mapping.close()
        for name in (slot.name, slot.name + ".free"):
            try:
                os.unlink(name, dir_fd=self.fd)
            except OSError:
                pass
        self._slots.remove(slot)

    def identity(self) -> dict[str, Any]:
        """The directory this worker opened, for its hello: its path and inode (the Elixir
        side sends slot names only to a worker that opened its own directory)."""
        return {"path": self.path, "ino": os.fstat(self.fd).st_ino}

    def close(self) -> None:
        """Deletes this worker's result slots (it is exiting)."""
        self._closed.set()
        with self._lock:
            for slot in list(self._slots):
                self._drop(slot)
        try:
            os.close(self.fd)
        except OSError:
            pass
