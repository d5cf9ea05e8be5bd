"""The worker's start-up stderr (vllm_bridge.bridge.worker.stderr): fd 2 on a private file
until the hello, then the real stderr back on fd 2 with the file's content copied to it.

Each test runs a child interpreter set up as the Elixir launcher sets one up (fd 2 on the
file, the real stderr on fd 5, the two variables), with a pipe as "the real stderr".
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_bridge.bridge.worker.stderr import FD_ENV, FILE_ENV, open_capture

CHILD = r"""
import os, sys, warnings
from vllm_bridge.bridge.worker.stderr import open_capture, take_back
print("before-1", file=sys.stderr)
capture = open_capture()
os.write(2, b"before-2\n")
take_back(capture)
print("after", file=sys.stderr, flush=True)
print(FILE in os.environ, FD in os.environ, file=sys.stdout)
try:
    os.fstat(5)
    print("fd5-open")
except OSError:
    print("fd5-closed")
"""


def run_child(tmp_path: Path, *, create_file: bool = True) -> tuple[str, str, str]:
    """The child's real stderr (the pipe), its stdout, and what the file held."""
    err_file = tmp_path / "start-stderr"
    read_end, write_end = os.pipe()
    env = dict(os.environ, **{FILE_ENV: str(err_file), FD_ENV: "5"})
    code = CHILD.replace("FILE", repr(FILE_ENV)).replace("FD", repr(FD_ENV))

    def on_fd5() -> None:
        os.dup2(write_end, 5)

    with open(err_file, "wb") if create_file else open(os.devnull, "wb") as fd2:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=fd2,
            env=env,
            preexec_fn=on_fd5,
            # fd 5 kept open through close_fds (it is made by on_fd5).
            pass_fds=(write_end, 5),
        )
    os.close(write_end)
    out, _ = proc.communicate(timeout=60)
    with os.fdopen(read_end, "rb") as r:
        real = r.read().decode()
    held = err_file.read_text() if err_file.exists() else ""
    assert proc.returncode == 0, real + held
    return real, out.decode(), held


def test_what_came_before_is_copied_to_the_real_stderr_in_order(tmp_path: Path) -> None:
    real, out, held = run_child(tmp_path)
    assert real.splitlines() == ["before-1", "before-2", "after"]
    # The file held only what came before the switch.
    assert held.splitlines() == ["before-1", "before-2"]
    # Neither variable nor the spare fd is passed on to what the worker starts.
    assert out.splitlines() == ["False False", "fd5-closed"]


def test_a_file_that_cannot_be_read_still_gives_the_real_stderr_back(tmp_path: Path) -> None:
    # The file named does not exist (fd 2 went elsewhere): said on the real stderr.
    real, _out, _held = run_child(tmp_path, create_file=False)
    lines = real.splitlines()
    assert lines[-1] == "after"
    assert any("cannot read its start-up stderr" in line for line in lines)


def test_no_capture_without_the_variables() -> None:
    assert open_capture({}) is None


@pytest.mark.parametrize("bad", ["x", "-1", "2", "", "5.0"])
def test_a_bad_fd_is_refused_by_value(bad: str) -> None:
    with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
        open_capture({FD_ENV: bad, FILE_ENV: "/nonexistent"})
