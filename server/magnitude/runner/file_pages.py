"""Give back the checkpoint file's pages that quantized weights no longer read (Linux).

Loading maps the safetensors file privately and every parameter is a view of that mapping, so a
page stays resident from its first read until the whole mapping goes. Quantizing reads each
linear's weight once and never again: `drop_pages(weight)` right after it is replaced keeps the
peak while quantizing at one linear's pages instead of the whole checkpoint's (SmolLM2 fp32: 513
MiB).

Only pages wholly inside the tensor's bytes and inside a file-backed mapping are dropped. A
private file mapping's clean page comes back from the file on the next read, so a page shared
with a weight still in use (tied embeddings) costs a re-read, never data; anonymous memory would
come back as zeros, so it is left alone. Elsewhere than Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from pathlib import Path

import torch

_MAPS = Path("/proc/self/maps")
_MADV_DONTNEED = 4  # Linux; not exported by the mmap module on every Python build


def file_backed_ranges() -> list[tuple[int, int]]:
    """[start, end) of every mapping of a regular file in this process (empty elsewhere than Linux)."""
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, _, end = fields[0].partition("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _madvise() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = ctypes.CDLL(name, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def drop_pages(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> int:
    """Drop the resident pages wholly inside `tensor`'s bytes that lie in one of `ranges` (from
    `file_backed_ranges`); returns the bytes dropped (0 off Linux, on a GPU or outside the ranges)."""
    if tensor.device.type != "cpu" or not ranges:
        return 0
    page = mmap.PAGESIZE
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    start = -(-first // page) * page
    end = last // page * page
    if end <= start or not any(lo <= start and end <= hi for lo, hi in ranges):
        return 0
    madvise = _madvise()
    if madvise is None or madvise(start, end - start, _MADV_DONTNEED) != 0:
        return 0
    return end - start
