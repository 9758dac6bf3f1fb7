"""Give back the resident pages of the checkpoint that quantized weights no longer read, of
CUDA libraries a CPU process never runs and of library code only start-up ran (Linux), and the
heap's free pages once loading is over (glibc).

Loading maps the safetensors file privately and every parameter is a view of that mapping, so a
page stays resident from its first read until the whole mapping goes. Quantizing reads each
linear's weight once and never again: `drop_pages(weight)` right after it is replaced asks the
kernel to reclaim that weight's pages (`MADV_PAGEOUT`, Linux 5.4+), so with the quantization
record cached a w4a16 or w8a16 load holds about one linear's pages at a time instead of the whole
checkpoint's (SmolLM2 fp32: 513 MiB). (w8a8's calibration forward, and measuring a record, read
every weight first: the pages are then given back as quantizing goes.)

Only pages wholly inside a contiguous tensor's bytes and inside a file mapping are asked for.
`MADV_PAGEOUT` never loses data: a clean page is dropped and comes back from the file on the next
read (a page shared with a weight still in use, such as tied embeddings, costs a re-read); a page
written since it was mapped is private memory and, with no swap, stays; and the kernel skips a page
another process maps too (a second engine on the same checkpoint file), which stays resident. What it lowers is the
process's resident set; the file's pages may stay in the page cache, which the kernel reclaims
under pressure. Elsewhere than Linux, or on an older kernel, it does nothing.

`released_after_use(module)`: measuring a quantization record runs the unquantized reference over
every weight many times (a forward per chunk and per decoded token), which would hold the whole
checkpoint's pages resident at once (SmolLM2 fp32: 537 MiB, a first start's peak). Inside it,
each linear's weight pages are unmapped right after the linear runs (`unmap_clean_pages`,
`MADV_DONTNEED`): they stay in the page cache, so the next forward maps them again with minor
faults and no I/O (`MADV_PAGEOUT` would evict them and make every forward read the file), and the
process holds about one linear's pages at a time. `MADV_DONTNEED` on a private mapping discards a
page the process wrote, so only pages `/proc/self/pagemap` reports as the file's own (or not
resident) are unmapped; a written page is left alone.

`page_out_gpu_libraries()`: torch's CUDA wheels map a dozen CUDA libraries (and Triton's compiler) at import, whose pages
the dynamic loader touched (about 150 MiB resident with torch 2.15 + CUDA 13); a runner on the CPU
never executes them, so it asks for them back the same way (a page read later comes back from the
file).

`page_out_shared_libraries()`: importing torch, transformers and the server, and loading, run code
from every shared library (torch's CPU library alone: ~63 MiB resident at ready), much of which
serving never runs again; `magnitude serve` asks for all of their read-only pages back once loading
is over, and the warm-up that follows maps back what a step runs. Both this and
`page_out_gpu_libraries` take effect only for library files the process owns or may write (the
kernel's rule for paging out a file's pages).

`trim_heap()`: loading and converting free hundreds of MiB in allocations glibc keeps in its
arenas (SmolLM2 w4a16: 92 MiB of the resident set); `malloc_trim(0)` returns their free pages to
the kernel. Elsewhere than glibc it does nothing.

`loading_heap()`: glibc serves an allocation above its mmap threshold with a mapping of its own,
given back whole when freed, and raises the threshold to the size of each such block freed (up to
32 MiB), so after the first large temporary most of loading's (converting, quantizing, measuring
a record) land in the per-thread arenas between blocks that stay live: freed, they stay resident
as fragments a trim cannot return (a first start: ~60-100 MiB more at ready than a restart, and a
higher peak). Within it the threshold is held at glibc's initial 128 KiB; on leaving, it is set to
the dynamic rule's ceiling, 32 MiB (and the trim threshold to twice that), so serving's steps reuse
arena memory as they did and nothing a step allocates pays for fresh pages each time.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

_MAPS = Path("/proc/self/maps")
_MADV_PAGEOUT = 21  # Linux 5.4+; not exported by the mmap module on every Python build
_MADV_DONTNEED = 4
_PAGEMAP = Path("/proc/self/pagemap")
# /proc/self/pagemap: one 64-bit entry per virtual page (Documentation/admin-guide/mm/pagemap.rst);
# bit 63, present, is read as the sign.
_PM_SWAPPED = 1 << 62
_PM_FILE_OR_SHARED = 1 << 61
# Any shared library or extension module, by the name it is mapped under.
SHARED_LIBRARY = re.compile(r"\.so(\.[0-9]+)*$")
# CUDA's own libraries and torch's CUDA parts, as torch's CUDA wheels ship them (nvidia-* packages), and
# Triton's compiler (a GPU kernel compiler torch imports with its inductor: ~66 MiB resident, never run here).
GPU_LIBRARY = re.compile(r"/lib(cublas|cudnn|cufft|curand|cusolver|cusparse|cufile|cupti|cudart|nccl|nvJitLink|nvrtc"
                         r"|nvshmem|nvToolsExt|torch_cuda|c10_cuda|triton)[^/]*\.so[^/]*$")


def _mappings() -> Iterator[tuple[int, int, str, str, str]]:
    """(start, end, permissions, inode, path) of every mapping with a path in /proc/self/maps
    (nothing elsewhere than Linux)."""
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6:
            start, _, end = fields[0].partition("-")
            yield int(start, 16), int(end, 16), fields[1], fields[4], fields[5].strip()


def file_backed_ranges() -> list[tuple[int, int]]:
    """[start, end) of every mapping of a regular file in this process (empty elsewhere than Linux)."""
    # A path and a nonzero inode: a regular file (not [heap], not a /dev/zero mapping).
    return [(lo, hi) for lo, hi, _perms, inode, path in _mappings()
            if path.startswith("/") and inode != "0" and not path.startswith("/dev/")]


@functools.cache  # find_library runs ldconfig: once per process
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name, use_errno=True)


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    libc = _libc()
    if libc is None:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def trim_heap() -> bool:
    """Return the C heap's free pages to the kernel (glibc `malloc_trim`); whether it could ask."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(ctypes.c_size_t(0))
    return True


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
LOADING_MMAP_THRESHOLD = 128 * 1024  # glibc's initial threshold, held: loading's temporaries map and unmap
SERVING_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its rule tops out


def _mallopt(param: int, value: int) -> bool:
    fn = getattr(_libc(), "mallopt", None)
    return fn is not None and fn(ctypes.c_int(param), ctypes.c_int(value)) == 1


@contextlib.contextmanager
def loading_heap() -> Iterator[bool]:
    """Within it, an allocation above 128 KiB that no free arena space fits (glibc reuses that
    first) is a mapping of its own, returned whole when freed; on leaving, the thresholds serving
    keeps (see the module's docstring). Yields whether glibc took the setting (False elsewhere than
    glibc, where it does nothing)."""
    took = _mallopt(_M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)
    try:
        yield took
    finally:
        if took:
            _mallopt(_M_MMAP_THRESHOLD, SERVING_MMAP_THRESHOLD)
            _mallopt(_M_TRIM_THRESHOLD, 2 * SERVING_MMAP_THRESHOLD)


def in_ranges(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether `tensor`'s first byte lies in one of `ranges`."""
    ptr = tensor.data_ptr()
    return tensor.device.type == "cpu" and any(lo <= ptr < hi for lo, hi in ranges)


def _page_span(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> tuple[int, int] | None:
    """[start, end) of the pages wholly inside a contiguous CPU tensor's bytes, when they lie in one
    of `ranges`; None otherwise."""
    if tensor.device.type != "cpu" or not ranges or not tensor.is_contiguous():
        return None
    page = mmap.PAGESIZE
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    start = -(-first // page) * page
    end = last // page * page
    if end <= start or not any(lo <= start and end <= hi for lo, hi in ranges):
        return None
    return start, end


def _clean_runs(start: int, end: int) -> list[tuple[int, int]]:
    """The runs of pages in [start, end) that are the file's own or not resident (pagemap), so
    unmapping them loses nothing: a page this process wrote (copy-on-write) or that was swapped out
    ends a run. Empty when pagemap cannot be read."""
    page = mmap.PAGESIZE
    try:
        with _PAGEMAP.open("rb") as f:
            f.seek(start // page * 8)
            raw = f.read((end - start) // page * 8)
    except OSError:
        return []
    if len(raw) != (end - start) // page * 8:
        return []
    # The flags sit in the top bits: read as int64, "present" is the sign bit.
    entries = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    present = entries < 0
    file_page = (entries & _PM_FILE_OR_SHARED) != 0
    swapped = (entries & _PM_SWAPPED) != 0
    safe = torch.where(present, file_page, ~swapped)
    if bool(safe.all()):
        return [(start, end)]
    runs, run_start = [], None
    for i, ok in enumerate(safe.tolist()):
        if ok and run_start is None:
            run_start = i
        elif not ok and run_start is not None:
            runs.append((start + run_start * page, start + i * page))
            run_start = None
    if run_start is not None:
        runs.append((start + run_start * page, end))
    return runs


def unmap_clean_pages(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> int:
    """Unmap the resident pages wholly inside `tensor`'s bytes that lie in one of `ranges` and are
    still the file's own (`MADV_DONTNEED`): the page cache keeps them, so the next read maps them
    again without I/O. Returns the bytes unmapped (0 off Linux, on a GPU, for a view that is not
    contiguous, outside the ranges, or where pagemap or the kernel refuses)."""
    span = _page_span(tensor, ranges)
    madvise = _madvise()
    if span is None or madvise is None:
        return 0
    return sum(hi - lo for lo, hi in _clean_runs(*span) if madvise(lo, hi - lo, _MADV_DONTNEED) == 0)


@contextlib.contextmanager
def released_after_use(module: torch.nn.Module) -> Iterator[int]:
    """Within it, every `nn.Linear` under `module` unmaps its weight's clean file pages
    (`unmap_clean_pages`) right after each call, so a forward over a mapped checkpoint holds about
    one linear's pages at a time. Yields the number of linears watched (0 when none is mapped)."""
    mapped = file_backed_ranges()
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear) and in_ranges(m.weight, mapped)]

    def release(linear: torch.nn.Module, _args: object, _output: object) -> None:
        unmap_clean_pages(linear.weight, mapped)

    handles = [m.register_forward_hook(release) for m in linears]
    try:
        yield len(linears)
    finally:
        for h in handles:
            h.remove()


def drop_pages(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> int:
    """Give back the resident pages wholly inside `tensor`'s bytes that lie in one of `ranges` (from
    `file_backed_ranges`); returns the bytes asked for (0 off Linux, on a GPU, for a view that is
    not contiguous, outside the ranges, or where the kernel refuses)."""
    span = _page_span(tensor, ranges)
    madvise = _madvise()
    if span is None or madvise is None or madvise(span[0], span[1] - span[0], _MADV_PAGEOUT) != 0:
        return 0
    return span[1] - span[0]


def _page_out_mappings(wanted: Callable[[str, str], bool]) -> int:
    """MADV_PAGEOUT every mapping of this process for which `wanted(permissions, path)` holds;
    returns the bytes of the mappings asked for (0 off Linux or where the kernel refuses)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    return sum(hi - lo for lo, hi, perms, _inode, path in _mappings()
               if wanted(perms, path) and madvise(lo, hi - lo, _MADV_PAGEOUT) == 0)


def page_out_gpu_libraries() -> int:
    """Ask back the resident pages of the CUDA libraries mapped into this process (GPU_LIBRARY), for
    a process that computes on the CPU only; returns the bytes of the mappings asked for (0 where
    none is mapped, off Linux, or where the kernel refuses). Nothing is lost: a page read again
    comes back from its file; a page the loader wrote is private memory and stays (or goes to swap,
    where there is any). See page_out_shared_libraries for whose files the kernel pages out."""
    return _page_out_mappings(lambda _perms, path: bool(GPU_LIBRARY.search(path)))


def page_out_shared_libraries() -> int:
    """Ask back the resident pages of every shared library's read-only mappings (code and
    constants), once loading is over and before the warm-up: importing and loading ran code that
    serving never runs again (`magnitude serve`, SmolLM2 on the CPU: 116 MiB of file pages resident at
    ready without this, 36 with it, 45 after serving traffic), and the warm-up maps back what a step
    runs.
    The kernel pages out a file's pages only for a process that owns the file or may write it
    (Linux's rule for MADV_PAGEOUT), and skips a page another process maps too: where the libraries
    belong to another user (an image that installs them as root and runs as another user), their
    pages stay. A page the loader wrote (a relocated constant) is private memory and stays, or goes
    to swap where there is any; any other comes back from its file when read again, a one-time
    fault. Returns the bytes of the mappings asked for."""
    return _page_out_mappings(lambda perms, path: "w" not in perms and bool(SHARED_LIBRARY.search(path)))
