"""NVIDIA MPS for the demo's processes on one GPU.

Colocated on CUDA, the engines and trainer rank 0 are processes of their own on GPU 0.
Without MPS the GPU time-slices between their contexts: the trainer's step beside
generation takes its own time plus the engine's kernels. Under MPS (the Multi-Process
Service: one server runs every client's kernels side by side) the ranks' step beside
generation took 60-62 ms against 71-79 on one H200, the asynchronous step 0.104 s against
0.105-0.112 without it (RESULTS.md, C-N). A synchronous run's processes take turns on the
GPU: under MPS its step was slower (0.177 s against 0.153), so the command runs it without.
The demo starts a daemon of its own (its pipe and log directories in a temporary
directory, so only its processes connect), runs in a child process whose children inherit
the daemon's address, and stops the daemon once that child has exited (MPS's ``quit`` waits
for every client). A daemon the caller runs (``CUDA_MPS_PIPE_DIRECTORY`` set, or the system's at its
default place) is used as it is, by every run."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CONTROL", "MPS_BOUND", "Mps", "mps_for", "private_mps"]

CONTROL = "nvidia-cuda-mps-control"
MPS_BOUND = 60.0  # seconds the daemon may take to start, serve a first client, or quit
_SYSTEM_PIPE = Path("/tmp/nvidia-mps/control")  # where a daemon started without settings listens

# A first client, in a process of its own: the daemon starts its server for it, so a
# server that cannot start (the GPU in use by another user's server, a container without
# the right) fails here, named, instead of in the demo's engines.
_PROBE = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
ctx = ctypes.c_void_p()
for what, rc in (("cuInit", lambda: cuda.cuInit(0)),
                 ("cuDevicePrimaryCtxRetain", lambda: cuda.cuDevicePrimaryCtxRetain(
                     ctypes.byref(ctx), 0))):
    code = rc()
    if code:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(code, ctypes.byref(name))
        sys.exit(f"{what} failed under MPS: {(name.value or b'?').decode()} ({code})")
"""


@dataclass(frozen=True)
class Mps:
    """Whether the run's processes share the GPU through MPS: ``env`` holds the settings
    its processes need (empty when they need none: off, or a daemon they find by default),
    ``why`` says which daemon, or why none; ``start``: a daemon of the run's own is to be
    started (:func:`private_mps`)."""

    on: bool
    why: str
    env: dict[str, str]
    start: bool = False


def mps_for(device: str, layout: str, launcher: str, refused: bool) -> Mps | None:
    """The MPS a run of these settings wants, before any daemon starts: None where MPS has
    nothing to share (not colocated on CUDA, or Ray's processes, which the demo does not
    start), an ``Mps`` that is off with the reason, or one that is on through the caller's
    daemon or, with ``start``, through one of the run's own."""
    if device != "cuda" or layout != "colocated" or launcher != "local":
        return None
    if refused:
        return Mps(False, "off (--no-mps)", {})
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        return Mps(True, f"the daemon at {os.environ['CUDA_MPS_PIPE_DIRECTORY']}", {})
    if _SYSTEM_PIPE.exists():
        return Mps(True, f"the system's daemon ({_SYSTEM_PIPE.parent})", {})
    if shutil.which(CONTROL) is None:
        return Mps(False, f"off ({CONTROL} is not on PATH: NVIDIA's driver tools)", {})
    return Mps(True, "a daemon of the run's own", {}, start=True)


@contextlib.contextmanager
def private_mps() -> Iterator[Mps]:
    """A daemon of its own while inside: yields an ``Mps`` that is on with the settings its
    clients need, or, where the daemon or its first client failed, one that is off saying
    why (the run goes on without MPS). The daemon is told to quit on the way out, when
    every client has exited."""
    tmp = Path(tempfile.mkdtemp(prefix="rlferry-mps-"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(tmp / "log")}
    for d in env.values():
        os.mkdir(d)
    full = {**os.environ, **env}
    why, running = _start(full, tmp / "log")
    if why is not None:
        if not running:  # else its pipes stay, so that the command said can still stop it
            shutil.rmtree(tmp, ignore_errors=True)
        yield Mps(False, f"off ({why})", {})
        return
    try:
        yield Mps(True, "a daemon of the run's own", env)
    finally:
        failed = _quit(full)
        if failed is None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # its pipes stay, so that the command said can still stop it
            print(f"rlferry demo: {failed}", file=sys.stderr)


def _start(env: dict[str, str], logs: Path) -> tuple[str | None, bool]:
    """Start the daemon and serve a first client: None, or why it failed (a daemon that
    started told to quit again), and whether a daemon is left running (it did not quit)."""
    try:
        done = subprocess.run(
            [CONTROL, "-d"], env=env, capture_output=True, text=True, timeout=MPS_BOUND
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{CONTROL} -d did not start the daemon: {e}", False
    if done.returncode:
        why = f"{CONTROL} -d exited with {done.returncode}: {done.stderr.strip()[-300:]}"
        return why, False
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
            timeout=MPS_BOUND,
        )  # fmt: skip
        failed = probe.stderr.strip()[-300:] if probe.returncode else None
    except subprocess.TimeoutExpired:
        failed = f"a first client did not connect within {MPS_BOUND:g} s"
    if failed is None:
        return None, True
    stuck = _quit(env)
    log = logs / "server.log"
    tail = log.read_text(errors="replace").strip()[-300:] if log.exists() else ""
    why = failed + (f"; the server's log ends: {tail}" if tail else "")
    return why + (f"; {stuck}" if stuck else ""), stuck is not None


def _quit(env: dict[str, str]) -> str | None:
    """Tell the daemon to quit (it waits for its clients: call once they exited)."""
    try:
        done = subprocess.run(
            [CONTROL], input="quit\n", env=env, capture_output=True, text=True,
            timeout=MPS_BOUND,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        done = None
    if done is not None and done.returncode == 0:
        return None
    return (
        f"the MPS daemon at {env['CUDA_MPS_PIPE_DIRECTORY']} did not quit within "
        f"{MPS_BOUND:g} s (a process of the run may still hold the GPU); stop it with: echo "
        f"quit | CUDA_MPS_PIPE_DIRECTORY={env['CUDA_MPS_PIPE_DIRECTORY']} {CONTROL}"
    )
