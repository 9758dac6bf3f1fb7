"""Give back the resident pages of the checkpoint that quantized weights no longer read and of
CUDA libraries a CPU process never runs (Linux), and the heap's free pages once loading is over
(glibc).

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

`page_out_gpu_libraries()`: torch's CUDA wheels map a dozen CUDA libraries (and Triton's compiler) at import, whose pages
the dynamic loader touched (about 150 MiB resident with torch 2.15 + CUDA 13); a runner on the CPU
never executes them, so it asks for them back the same way (a page read later comes back from the
file).

`trim_heap()`: loading and converting free hundreds of MiB in allocations glibc keeps in its
arenas (SmolLM2 w4a16: 92 MiB of the resident set); `malloc_trim(0)` returns their free pages to
the kernel. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import re
from pathlib import Path

import torch

_MAPS = Path("/proc/self/maps")
_MADV_PAGEOUT = 21  # Linux 5.4+; not exported by the mmap module on every Python build
# CUDA's own libraries and torch's CUDA parts, as torch's CUDA wheels ship them (nvidia-* packages), and
# Triton's compiler (a GPU kernel compiler torch imports with its inductor: ~66 MiB resident, never run here).
GPU_LIBRARY = re.compile(r"/lib(cublas|cudnn|cufft|curand|cusolver|cusparse|cufile|cupti|cudart|nccl|nvJitLink|nvrtc"
                         r"|nvshmem|nvToolsExt|torch_cuda|c10_cuda|triton)[^/]*\.so[^/]*$")


def file_backed_ranges() -> list[tuple[int, int]]:
    """[start, end) of every mapping of a regular file in this process (empty elsewhere than Linux)."""
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        # A path and a nonzero inode: a regular file (not [heap], not a /dev/zero mapping).
        if len(fields) == 6 and fields[5].startswith("/") and fields[4] != "0" and not fields[5].startswith("/dev/"):
            start, _, end = fields[0].partition("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


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


def in_ranges(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether `tensor`'s first byte lies in one of `ranges`."""
    ptr = tensor.data_ptr()
    return tensor.device.type == "cpu" and any(lo <= ptr < hi for lo, hi in ranges)


def drop_pages(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> int:
    """Give back the resident pages wholly inside `tensor`'s bytes that lie in one of `ranges` (from
    `file_backed_ranges`); returns the bytes asked for (0 off Linux, on a GPU, for a view that is
    not contiguous, outside the ranges, or where the kernel refuses)."""
    if tensor.device.type != "cpu" or not ranges or not tensor.is_contiguous():
        return 0
    page = mmap.PAGESIZE
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    start = -(-first // page) * page
    end = last // page * page
    if end <= start or not any(lo <= start and end <= hi for lo, hi in ranges):
        return 0
    madvise = _madvise()
    if madvise is None or madvise(start, end - start, _MADV_PAGEOUT) != 0:
        return 0
    return end - start


def page_out_gpu_libraries() -> int:
    """Ask back the resident pages of the CUDA libraries mapped into this process (GPU_LIBRARY), for
    a process that computes on the CPU only; returns the bytes of the mappings asked for (0 where
    none is mapped, off Linux, or where the kernel refuses). Nothing is lost: a page read again
    comes back from its file, a page the loader wrote is private memory and stays."""
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return 0
    madvise = _madvise()
    if madvise is None:
        return 0
    asked = 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and GPU_LIBRARY.search(fields[5].strip()):
            start, _, end = fields[0].partition("-")
            lo, hi = int(start, 16), int(end, 16)
            if madvise(lo, hi - lo, _MADV_PAGEOUT) == 0:
                asked += hi - lo
    return asked
