"""Grouped copies: many ``(dst, src)`` tensor pairs copied by one kernel launch.

An engine's ``load`` copies every tensor of a bucket into its parameters. With
``torch._foreach_copy_`` over the 18,867 tensors of Qwen3-30B-A3B that copy
alone takes 2.37x a flat copy of the same bytes on an H200 (many 3 MB expert
tensors, small grids per launch; ``python benchmarks/weights.py --transport
cuda_ipc --model qwen3-30b-a3b``). A :class:`GroupedCopy` is built once for a
fixed set of pairs (shapes checked, a table of 16-byte aligned chunks made
on the device) and then copies them all with one launch of a Triton kernel.
The pairs are fixed across pushes (the plan is), so the table is too. A
strided view (a trainer rank's columns of a row-parallel weight, say) is
taken as its runs of contiguous bytes, a table row each: packing a sharded
push's 616 pieces one ``copy_`` at a time keeps an H200's trainer rank busy
launching for 10-14 ms while its GPU idles.

Triton is optional and imported only when a CUDA copy is built. CPU pairs of
one dtype go through rlferry's bulk host copy (chunked over threads, streaming
stores); without Triton and for other pairs the kernel does not take (see
:class:`GroupedCopy`), torch's ``_foreach_copy_`` copies instead.
"""

from __future__ import annotations

import importlib.util
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from rlferry.errors import RequestError
from rlferry.wire.lowlevel import BulkCopy, bytes_copy

from ..delta import Delta

__all__ = ["GroupedCopy", "ParamLoader", "chunk_table"]

CHUNK_BYTES = 512 << 10  # one table row: 32 programs of 16 KiB
MIN_RUN_BYTES = 512  # a strided view of over SMALL_BYTES with shorter runs is copied by torch
SMALL_BYTES = 1 << 20
_ALIGN = 16


def triton_available() -> bool:
    """Whether Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def load_kernels(device: torch.device) -> None:
    """Load the grouped copy's kernels on a CUDA ``device`` now (once a process; nothing
    without Triton): before any NCCL work of a link runs there (see ``_copy_kernel.load``)."""
    if device.type == "cuda" and triton_available():
        from ._copy_kernel import load

        load(device)


def chunk_table(
    src: Sequence[int] | torch.Tensor,
    dst: Sequence[int] | torch.Tensor,
    nbytes: Sequence[int] | torch.Tensor,
    chunk: int = CHUNK_BYTES,
) -> torch.Tensor:
    """Rows ``(src address, dst address, 4-byte words)`` covering each pair, in order, in
    pieces of at most ``chunk`` bytes (int64, on the CPU; shape (rows, 3))."""
    if not len(src):
        return torch.zeros((0, 3), dtype=torch.int64)
    s = torch.as_tensor(src, dtype=torch.int64)
    d = torch.as_tensor(dst, dtype=torch.int64)
    n = torch.as_tensor(nbytes, dtype=torch.int64)
    counts = (n + chunk - 1) // chunk
    pair = torch.repeat_interleave(torch.arange(len(n)), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    off = (torch.arange(int(counts.sum())) - first) * chunk
    words = torch.clamp(n[pair] - off, max=chunk) // 4
    return torch.stack([s[pair] + off, d[pair] + off, words], dim=1)


def _inner(t: torch.Tensor) -> int:
    """How many elements at a time ``t`` holds contiguously (a product of its last sizes)."""
    c = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        if size == 1:
            continue
        if stride != c:
            break
        c *= size
    return c


def _offsets(t: torch.Tensor, inner: int) -> torch.Tensor:
    """The element offsets from ``t``'s first element of its runs of ``inner`` elements,
    in ``t``'s order (int64, on the CPU); ``inner`` is a product of ``t``'s last sizes."""
    sizes, strides = list(t.shape), list(t.stride())
    n = 1
    while n < inner:
        n *= sizes.pop()
        strides.pop()
    off = torch.zeros(1, dtype=torch.int64)
    for size, stride in zip(sizes, strides, strict=True):
        off = (off[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    return off


def runs(d: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """The pair as runs the kernel copies: ``(source addresses, destination addresses, bytes
    a run)``, or None when the kernel does not take it: another device or dtype, a lazy
    conjugate or negative view, a destination that repeats an element, addresses not 16-byte
    aligned or sizes not a multiple of 16 bytes, or a strided view of over SMALL_BYTES in
    runs under MIN_RUN_BYTES (a table row each would cost more than torch's strided copy)."""
    if not (d.is_cuda and s.device == d.device and s.dtype == d.dtype and d.numel() > 0):
        return None
    if d.is_conj() or s.is_conj() or d.is_neg() or s.is_neg():
        return None
    if any(st == 0 and n > 1 for n, st in zip(d.shape, d.stride(), strict=True)):
        return None
    e = d.element_size()
    inner = min(_inner(d), _inner(s))
    run = inner * e
    short = inner < d.numel() and run < MIN_RUN_BYTES and d.numel() * e > SMALL_BYTES
    if run % _ALIGN or short:
        return None
    src = s.data_ptr() + _offsets(s, inner) * e
    dst = d.data_ptr() + _offsets(d, inner) * e
    if bool(((src | dst) % _ALIGN).any()):
        return None
    return src, dst, run


class GroupedCopy:
    """``dst[i].copy_(src[i])`` for every pair, the CUDA pairs by one Triton launch.

    Built once: checks every pair's shape (``ValueError`` naming the tensor,
    ``names[i]`` or its position), then puts each pair the kernel takes into a
    table of chunks of at most 512 KiB on the device. The kernel takes a pair
    whose two tensors are contiguous, on the same CUDA device, of one dtype,
    with 16-byte aligned addresses and a size a multiple of 16 bytes. Every
    other pair (CPU tensors, a dtype to convert, a strided view, odd sizes),
    and every pair when Triton is not installed, is copied by
    ``torch._foreach_copy_`` in the same call: same result, one launch per
    group of tensors instead of one in all. CPU pairs of one dtype, contiguous,
    are copied as bytes by rlferry's bulk host copy. ``fused``, ``host`` and
    ``fallback`` count the pairs of each kind; ``why`` says why any pair fell
    back to torch.

    Calling it copies on the current stream (on CUDA it returns before the
    copy is done, like ``copy_``). The table holds the tensors' addresses: the
    copy keeps references to both lists, so they stay alive; with
    ``keep=False`` it keeps only the addresses of the pairs it copies by address
    (the pairs torch copies it keeps) and the caller must keep those tensors
    alive, unmoved, while it calls (rlferry's own packer does).

    ``programs``: None launches a program per 16 KiB tile, the fastest when
    the copy has the GPU to itself; a number bounds the grid (each program
    loops over chunks) so that a collective running beside the copy keeps
    its SMs: on an H200 pair a full grid beside NCCL slows a Qwen3-30B-A3B
    broadcast from 192 to 224 ms at normal stream priority (``python
    benchmarks/weights.py --transport broadcast --model qwen3-30b-a3b``).
    """

    def __init__(
        self,
        dst: Iterable[torch.Tensor],
        src: Iterable[torch.Tensor],
        *,
        names: Sequence[str] | None = None,
        keep: bool = True,
        programs: int | None = None,
    ) -> None:
        if programs is not None and programs < 1:
            raise RequestError(f"GroupedCopy.programs: expected None or >= 1, got {programs}")
        self.programs = programs
        dsts, srcs = list(dst), list(src)
        if len(dsts) != len(srcs):
            raise RequestError(
                f"GroupedCopy: expected as many sources as destinations ({len(dsts)}), "
                f"got {len(srcs)}"
            )
        if names is not None and len(names) != len(dsts):
            raise RequestError(
                f"GroupedCopy: expected a name per pair ({len(dsts)}), got {len(names)}"
            )
        for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):
            _check_pair(d, s, names[i] if names is not None else f"#{i}")
        use_kernel = triton_available() and any(d.is_cuda for d in dsts)
        found = {i: runs(d, s) for i, (d, s) in enumerate(zip(dsts, srcs, strict=True))
                 if use_kernel}  # fmt: skip
        fused = [i for i, r in found.items() if r is not None]
        taken = set(fused)
        host = [i for i in range(len(dsts)) if i not in taken and bytes_copy(dsts[i], srcs[i])]
        taken.update(host)
        rest = [i for i in range(len(dsts)) if i not in taken]
        self.fused, self.host, self.fallback = len(fused), len(host), len(rest)
        self.why = _why(dsts, srcs, rest, use_kernel)
        self._host = BulkCopy(  # CPU pairs: one bulk copy (chunked, on several threads)
            [(d.data_ptr(), s.data_ptr(), d.numel() * d.element_size())
             for d, s in ((dsts[i], srcs[i]) for i in host)]
        ) if host else None  # fmt: skip
        self._rest_dst = [dsts[i] for i in rest]
        self._rest_src = [srcs[i] for i in rest]
        self._kept = (dsts, srcs) if keep else None
        self._table: torch.Tensor | None = None
        self._tiles = 0
        self._launch: Callable[[], None] | None = None  # the kernel's launch, once made
        self.strided = 0  # fused pairs taken as several runs
        if fused:
            from ._copy_kernel import BLOCK_WORDS

            parts = [found[i] for i in fused]
            self.strided = sum(len(p[0]) > 1 for p in parts if p is not None)
            table = chunk_table(
                torch.cat([p[0] for p in parts if p is not None]),
                torch.cat([p[1] for p in parts if p is not None]),
                torch.cat([torch.full_like(p[0], p[2]) for p in parts if p is not None]),
            )
            self._table = table.to(dsts[fused[0]].device)
            self._tiles = CHUNK_BYTES // (4 * BLOCK_WORDS)
            if self.strided and programs is None:
                # short rows: a program per tile would launch mostly empty programs
                sms = torch.cuda.get_device_properties(self._table.device).multi_processor_count
                self.programs = 8 * sms

    @torch.no_grad()
    def __call__(self) -> None:
        if self._table is not None:
            if self._launch is None:
                from ._copy_kernel import launcher

                self._launch = launcher(self._table, self._tiles, programs=self.programs)
            else:
                self._launch()
        if self._host is not None:
            self._host()
        if self._rest_dst:
            torch._foreach_copy_(self._rest_dst, self._rest_src)


def _check_pair(d: Any, s: Any, name: str) -> None:
    for what, t in (("destination", d), ("source", s)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"GroupedCopy: tensor `{name}`: expected a torch.Tensor as {what}, "
                f"got {type(t).__name__}"
            )
    if d.shape != s.shape:
        raise RequestError(
            f"GroupedCopy: tensor `{name}`: expected shape {tuple(d.shape)} (the "
            f"destination's), got {tuple(s.shape)}"
        )


def _why(dsts: list[torch.Tensor], srcs: list[torch.Tensor], rest: list[int], kernel: bool) -> str:
    if not rest:
        return ""
    i = rest[0]
    d, s = dsts[i], srcs[i]
    if d.is_cuda and not kernel:
        return "triton is not installed"
    if s.device != d.device:
        why = f"source on {s.device}, destination on {d.device}"
    elif s.dtype != d.dtype:
        why = f"dtype {s.dtype} copied into {d.dtype}"
    elif not d.is_cuda:  # on the CPU only pairs in order go as bytes
        why = "not contiguous"
    elif d.is_conj() or s.is_conj() or d.is_neg() or s.is_neg():
        why = "a lazy conjugate or negative view"
    elif d.numel() == 0:
        why = "empty"
    elif any(st == 0 and n > 1 for n, st in zip(d.shape, d.stride(), strict=True)):
        why = "a destination that repeats an element"
    else:
        run = min(_inner(d), _inner(s)) * d.element_size()
        strided = not (d.is_contiguous() and s.is_contiguous())
        if strided and run % _ALIGN:
            why = f"strided, in runs of {run} bytes (not a multiple of {_ALIGN})"
        elif strided and run < MIN_RUN_BYTES:
            why = (
                f"strided, in runs of {run} bytes (under {MIN_RUN_BYTES}, over {SMALL_BYTES} bytes)"
            )
        else:
            why = "not 16-byte aligned"
    more = f" (and {len(rest) - 1} more)" if len(rest) > 1 else ""
    return f"{len(rest)} pairs by torch: the first ({i}): {why}{more}"


class ParamLoader:
    """A ``load`` for :class:`~rlferry.weights.WeightReceiver`: each bucket's tensors are
    copied into ``params[name]`` (the engine's tensors, by the pushed names) with one
    :class:`GroupedCopy`.

    A bucket's copy is built the first time it comes and reused for as long as
    rlferry hands the same bucket again, which it does while the plan and its
    buffers stay the same (the copy is dropped with rlferry's list of the
    bucket's views). A list made by the caller is copied by a copy built for
    that call. ``programs``: see :class:`GroupedCopy` (set it, e.g. to 64, for
    a broadcast receiver: its loads run beside NCCL).

    A delta push's ``(name, Delta)`` items (a receiver with ``deltas="in_place"``) are
    applied to ``params[name]`` in place (``Delta.apply_``: the parameter must be
    contiguous), the bucket's other tensors copied as above.

    Raises ``ValueError`` for a name that is not in ``params`` or a shape that
    differs, naming the tensor (the receiver reports it to the sender).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], *, programs: int | None = None) -> None:
        self.params = params
        self.programs = programs
        self.built = 0
        self._copies: dict[int, GroupedCopy] = {}

    def __call__(self, items: list[tuple[str, Any]]) -> None:
        if any(isinstance(t, Delta) for _, t in items):
            self._apply(items)
            return
        copy = self._copies.get(id(items))
        if copy is None:
            copy = self._build(items)
            try:
                weakref.finalize(items, self._copies.pop, id(items), None)
            except TypeError:  # not rlferry's list (a plain list cannot be watched): no cache
                copy()
                return
            self._copies[id(items)] = copy
        copy()

    def _apply(self, items: list[tuple[str, Any]]) -> None:
        """A delta push's bucket: its deltas applied, its dense tensors copied."""
        self._check([n for n, _ in items])
        dense = []
        for name, t in items:
            if isinstance(t, Delta):
                t.apply_(self.params[name])
            else:
                dense.append((name, t))
        if dense:
            self._build(dense)()

    def _check(self, names: list[str]) -> None:
        missing = [n for n in names if n not in self.params]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise RequestError(
                f"ParamLoader: tensor `{missing[0]}`{more}: not a parameter of this engine "
                f"(expected one of its {len(self.params)} names)"
            )

    def _build(self, items: list[tuple[str, torch.Tensor]]) -> GroupedCopy:
        names = [n for n, _ in items]
        self._check(names)
        self.built += 1
        return GroupedCopy(
            [self.params[n] for n in names], [t for _, t in items], names=names,
            programs=self.programs,
        )  # fmt: skip

    @property
    def cached(self) -> int:
        """Bucket copies kept now (``built``: built in all)."""
        return len(self._copies)
