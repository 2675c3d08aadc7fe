"""The Triton kernel of :class:`GroupedCopy`; imported only when a grouped copy runs on CUDA.

One launch copies every chunk of a table: row ``c`` holds ``(src address,
dst address, 4-byte words)``, every address 16-byte aligned and every length a
multiple of 16 bytes. The grid is ``(chunks, tiles per chunk)``: program
``(c, t)`` copies words ``[t * BLOCK, (t + 1) * BLOCK)`` of chunk ``c`` (masked
at the chunk's end; a program past it returns at once) with 16-byte loads and
stores (the alignment hints make Triton emit ``ld.global.v4.b32``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK_WORDS", "launcher", "load"]

log = logging.getLogger("rlferry.weights")

BLOCK_WORDS = 4096  # 16 KiB per program: 256 threads, four 16-byte loads each
_WARPS = 8


@triton.jit
def _copy_tiles(table, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    c = tl.program_id(0)
    t = tl.program_id(1)
    row = table + c * 3
    n = tl.multiple_of(tl.load(row + 2), 4)
    start = t * BLOCK
    if start < n:
        src = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int32)), 16)
        dst = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int32)), 16)
        o = start + tl.arange(0, BLOCK)
        m = o < n
        v = tl.load(src + o, mask=m, cache_modifier=".cg")
        tl.store(dst + o, v, mask=m, cache_modifier=".cs")


@triton.jit(do_not_specialize=["rows"])  # one compiled kernel for any row count (see load)
def _copy_rows(table, rows, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """A bounded grid: each program copies rows p, p + programs, ... tile by tile (as many
    tiles as the row holds: a short row, a strided view's run, costs one)."""
    for c in range(tl.program_id(0), rows, tl.num_programs(0)):
        row = table + c * 3
        n = tl.multiple_of(tl.load(row + 2), 4)
        src = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int32)), 16)
        dst = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int32)), 16)
        for t in range(0, tl.cdiv(n, BLOCK)):
            o = t * BLOCK + tl.arange(0, BLOCK)
            m = o < n
            v = tl.load(src + o, mask=m, cache_modifier=".cg")
            tl.store(dst + o, v, mask=m, cache_modifier=".cs")


def launcher(
    table: torch.Tensor, tiles: int, block: int = BLOCK_WORDS, programs: int | None = None
) -> Callable[[], None]:
    """Copy every chunk of ``table`` (int64, shape (chunks, 3), on the device) on the
    current stream, now, and return what copies it again. ``tiles``: tiles per chunk
    (chunk words / ``block``). ``programs``: at most that many programs (each looping
    over chunks), leaving the other SMs free (for a collective running beside the
    copy); None: one program per tile.

    The first launch goes through Triton's JIT, which compiles the kernel (or finds it
    compiled) and returns it; the later ones call that compiled kernel's own launcher
    with the same grid and arguments, skipping the JIT's argument binding and cache
    lookup: 18-31 us of host time a grouped copy of 399 pairs against 45-49 us on an H100
    host (Triton 3.6); a bucket's pack and its load each launch once. A Triton whose
    compiled kernel takes its arguments otherwise keeps launching through the JIT."""
    dev = table.device
    fn: Any
    args: tuple[Any, ...]
    if programs is None:
        fn, grid, args = _copy_tiles, (table.shape[0], tiles, 1), (table,)
    else:
        fn, grid, args = _copy_rows, (min(programs, table.shape[0]), 1, 1), (table, table.shape[0])
    with torch.cuda.device(dev):
        compiled = fn[grid](*args, BLOCK=block, num_warps=_WARPS)

    def jit() -> None:
        with torch.cuda.device(dev):
            fn[grid](*args, BLOCK=block, num_warps=_WARPS)

    try:
        runner = compiled[grid]
    except (TypeError, AttributeError, KeyError) as e:  # no compiled kernel to call
        log.debug("grouped copy: launching through Triton's JIT (%s)", e)
        return jit
    # the compiled kernel's launcher takes the runtime arguments alone (Triton < 3.3) or
    # every argument, constexprs included: the first that parses is the one (a list it
    # does not parse launches nothing; the one it does copies the same bytes again)
    for given in (args, (*args, block)):
        try:
            with torch.cuda.device(dev):
                runner(*given)
        except TypeError:
            continue
        break
    else:
        log.debug("grouped copy: the compiled kernel took no argument list; through the JIT")
        return jit

    def again() -> None:
        with torch.cuda.device(dev):
            runner(*given)

    return again


_loaded: set[int] = set()
_loading = threading.Lock()


def load(device: torch.device) -> None:
    """Compile (or find compiled) and load both kernels on ``device`` now, once a process,
    by copying 256 bytes with each. CUDA loads a kernel at its first launch, and may wait
    for the device's running kernels to do so; a receive running for one NCCL link then
    waits for its sender. A link's first grouped copy, loaded in the middle of an update,
    can hang 2 trainer ranks to 2 engine ranks: an engine rank's thread loading the
    kernel while its other link's receive runs. A link loads them before its group
    forms."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _loading:
        if index in _loaded:
            return
        dev = torch.device("cuda", index)
        buf = torch.zeros(128, dtype=torch.int32, device=dev)
        table = torch.empty((1, 3), dtype=torch.int64, device=dev)  # filled on the device
        table[0, 0], table[0, 1], table[0, 2] = buf.data_ptr(), buf.data_ptr() + 256, 64
        launcher(table, 1)
        launcher(table, 1, programs=1)
        _loaded.add(index)  # buf and table go back to the allocator after the copies ran
