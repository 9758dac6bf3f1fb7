"""`runner/file_pages.py`: pages of the checkpoint's mapping that quantized weights no longer read
are given back, a dropped page comes back from the file with its data, a page written since
loading keeps its data, and anonymous memory is never asked for; inside `released_after_use` a
linear's weight pages are unmapped after each call and it still computes the same product; inside
`loading_heap` a large allocation is a mapping of its own, and after it one lands in an arena again."""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from magnitude.runner.file_pages import (  # noqa: E402
    GPU_LIBRARY, drop_pages, file_backed_ranges, released_after_use, unmap_clean_pages)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _resident_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path`."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_a_mapped_weights_pages_are_dropped_and_read_back_from_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    original = torch.randn(1 << 20)  # 4 MiB
    safetensors_torch.save_file({"w": original}, path)
    weight = safetensors_torch.load_file(path)["w"]
    assert float(weight.sum()) == pytest.approx(float(original.sum()))  # every page read
    before = _resident_kib(path)
    assert before >= 4000

    dropped = drop_pages(weight, file_backed_ranges())

    assert dropped >= (4 << 20) - 2 * mmap.PAGESIZE
    assert _resident_kib(path) <= before - dropped // 1024
    assert torch.equal(weight, original)  # read back from the file, bit for bit


def test_anonymous_memory_is_never_dropped():
    weight = torch.randn(1 << 20)
    kept = weight.clone()
    assert drop_pages(weight, file_backed_ranges()) == 0
    assert torch.equal(weight, kept)


def test_a_page_written_since_loading_keeps_its_data(tmp_path):
    """A written page of a private mapping is the process's own memory: asking it back must not
    lose the write (MADV_DONTNEED would bring back the file's zeros)."""
    path = tmp_path / "w.safetensors"
    safetensors_torch.save_file({"w": torch.zeros(1 << 20)}, path)
    weight = safetensors_torch.load_file(path)["w"]
    weight.fill_(3.0)
    drop_pages(weight, file_backed_ranges())
    assert torch.equal(weight, torch.full((1 << 20,), 3.0))


def test_only_pages_wholly_inside_the_tensor_are_asked_for(tmp_path):
    """Two multi-page tensors back to back, their boundary inside a page: giving back `a` must
    leave `b`'s written values alone, and a view that is not contiguous asks for nothing."""
    path = tmp_path / "w.safetensors"
    page_floats = mmap.PAGESIZE // 4
    safetensors_torch.save_file({"a": torch.zeros(3 * page_floats + 100), "b": torch.zeros(3 * page_floats)}, path)
    loaded = safetensors_torch.load_file(path)
    a, b = loaded["a"], loaded["b"]
    b.fill_(5.0)  # every page of b, including the one it shares with a's tail
    assert 0 < drop_pages(a, file_backed_ranges()) < a.numel() * 4
    assert torch.equal(b, torch.full_like(b, 5.0))
    assert drop_pages(a.view(-1, 4)[:, 0], file_backed_ranges()) == 0  # strided view


def test_unmapped_clean_pages_read_back_the_files_data_and_written_pages_are_kept(tmp_path):
    """MADV_DONTNEED on a private file mapping discards what the process wrote: unmap_clean_pages
    unmaps only the pages pagemap reports as the file's own, so a written page keeps its value
    while the clean ones around it leave the resident set and read back bit for bit."""
    path = tmp_path / "w.safetensors"
    original = torch.randn(1 << 20)  # 4 MiB
    safetensors_torch.save_file({"w": original}, path)
    weight = safetensors_torch.load_file(path)["w"]
    assert float(weight.sum()) == pytest.approx(float(original.sum()))  # every page read
    written = 5 * (mmap.PAGESIZE // 4) + 7  # a float in the sixth page
    weight[written] = 42.0
    before = _resident_kib(path)

    unmapped = unmap_clean_pages(weight, file_backed_ranges())

    assert (4 << 20) - 4 * mmap.PAGESIZE <= unmapped < 4 << 20  # all but the written page (and the edges)
    assert _resident_kib(path) <= before - unmapped // 1024
    assert float(weight[written]) == 42.0
    expected = original.clone()
    expected[written] = 42.0
    assert torch.equal(weight, expected)
    assert unmap_clean_pages(torch.randn(1 << 20), file_backed_ranges()) == 0  # anonymous: never


def test_a_linear_inside_released_after_use_gives_its_pages_back_after_each_call(tmp_path):
    path = tmp_path / "lin.safetensors"
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 8))
    safetensors_torch.save_file({k: v.contiguous() for k, v in source.state_dict().items()}, path)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 8))
    model.load_state_dict(safetensors_torch.load_file(path), assign=True)  # views of the mapping
    x = torch.randn(3, 1024)
    with torch.inference_mode():
        expected = source(x)
        with released_after_use(model) as watched:
            assert watched == 2
            first = model(x)
            after_first = _resident_kib(path)
            second = model(x)  # the pages come back from the page cache
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert after_first < 64  # the 4 MiB weight read by the call is no longer resident
    assert not model[0]._forward_hooks  # the hooks go with the context
    with torch.inference_mode():
        model(x)
    assert _resident_kib(path) >= 4000  # outside it, a call leaves its pages resident


def _library_clean_kib(pattern: re.Pattern[str] | None = None) -> tuple[int, dict[str, tuple[int, int]]]:
    """Resident clean (file-backed, unwritten) KiB of the mappings of the libraries `pattern` finds
    (the CUDA libraries by default), and the readable mappings' ranges by library."""
    pattern = pattern or GPU_LIBRARY
    total, inside, readable = 0, False, {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and bool(pattern.search(fields[5]))
            if inside and fields[1].startswith("r"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                name = Path(fields[5]).name
                if hi - lo > readable.get(name, (0, 0))[1] - readable.get(name, (0, 0))[0]:
                    readable[name] = (lo, hi)
        elif inside and fields[0] in ("Private_Clean:", "Shared_Clean:"):
            total += int(fields[1])
    return total, readable


def _skip_unless_the_kernel_pages_out(pattern: re.Pattern[str]) -> None:
    """Skip where a mapped library `pattern` finds belongs to another user and is not writable here:
    Linux pages a file's pages out only for a process that owns the file or may write it (see
    page_out_shared_libraries)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not pattern.search(fields[5]):
            continue
        library = Path(fields[5].removesuffix(" (deleted)"))
        try:
            owner = library.stat().st_uid
        except OSError:
            pytest.skip(f"{fields[5]} is mapped but cannot be read from its path")
        if owner != os.geteuid() and not os.access(library, os.W_OK):
            pytest.skip(f"{library} belongs to uid {owner}, not this process's {os.geteuid()}, "
                        "and is not writable here: the kernel would not page it out")


def test_a_cpu_process_gives_back_the_cuda_libraries_pages_and_still_computes():
    """torch's CUDA wheel maps CUDA's libraries at import; a CPU runner asks their pages back
    (`page_out_gpu_libraries`, called by ModelRunner on the CPU), and CPU work is unaffected."""
    from magnitude.runner.file_pages import page_out_gpu_libraries

    _, readable = _library_clean_kib()
    if not readable:
        pytest.skip("no CUDA library is mapped (a CPU-only torch build)")
    _skip_unless_the_kernel_pages_out(GPU_LIBRARY)
    lo, hi = max(readable.values(), key=lambda r: r[1] - r[0])
    ctypes.string_at(lo, min(hi - lo, 8 << 20))  # read: its pages are resident now, whatever ran before
    before, _ = _library_clean_kib()
    asked = page_out_gpu_libraries()
    after, _ = _library_clean_kib()
    print(f"\nCUDA libraries {sorted(readable)}: {before} KiB of clean pages resident, {after} KiB after "
          f"asking {asked >> 20} MiB back")
    assert before >= 4096 and asked > 0
    assert after < before / 4
    a = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(a @ a.t(), torch.tensor([[14.0, 38.0, 62.0], [38.0, 126.0, 214.0], [62.0, 214.0, 366.0]]))


@pytest.mark.model
def test_a_serving_runner_gives_back_its_libraries_start_up_pages_and_generates_the_same(tmp_path):
    """`ModelRunner(page_out_libraries=True)`, what `magnitude serve` builds on the CPU, asks back
    the read-only pages of every shared library once the weights are loaded: torch's CPU library,
    read whole before, is mostly not resident after; then the warm-up and the steps map back what
    they run, and it generates what a runner without it generates. (Skipped where the library
    belongs to another user: see page_out_shared_libraries.)"""
    from magnitude.engine.sampling import SamplingParams
    from magnitude.runner import ModelRunner
    from magnitude.runner.file_pages import SHARED_LIBRARY

    from .conftest import drive_scheduler
    from .tiny_models import build_tiny_model

    torch_cpu = re.compile(r"/libtorch_cpu\.so$")
    path = build_tiny_model("llama", tmp_path / "tiny")
    plain = ModelRunner(str(path), device="cpu", dtype="float32", num_blocks=32, seed=0, num_threads=1)
    _, readable = _library_clean_kib(torch_cpu)
    if not readable:
        pytest.skip("torch's CPU library is not mapped under the name libtorch_cpu.so here")
    _skip_unless_the_kernel_pages_out(torch_cpu)
    lo, hi = readable["libtorch_cpu.so"]
    for start in range(lo, hi, 16 << 20):  # its largest readable mapping, resident now whatever ran before
        ctypes.string_at(start, min(hi - start, 16 << 20))
    before, _ = _library_clean_kib(torch_cpu)
    all_before, _ = _library_clean_kib(SHARED_LIBRARY)
    serving = ModelRunner(str(path), device="cpu", dtype="float32", num_blocks=32, seed=0, num_threads=1,
                          warmup=False, page_out_libraries=True)
    after, _ = _library_clean_kib(torch_cpu)
    all_after, _ = _library_clean_kib(SHARED_LIBRARY)
    print(f"\nlibtorch_cpu.so: {before} KiB of clean pages resident before the serving runner's load, {after} after; "
          f"every shared library: {all_before} -> {all_after} KiB")
    assert before >= 16384 and after < before / 4
    prompts = [[1, 5, 9, 13, 17, 21], [1, 7, 3]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    assert drive_scheduler(serving, prompts, greedy).outputs == drive_scheduler(plain, prompts, greedy).outputs


# Run in a fresh process: one thread, one arena, no free space left by earlier tests that glibc
# would reuse before mapping anything (it maps a block only when no free space fits it).
_LOADING_HEAP_PROBE = """
import ctypes, sys
from pathlib import Path
from magnitude.runner.file_pages import loading_heap

libc = ctypes.CDLL(None)
if getattr(libc, "mallopt", None) is None:
    print("not glibc"); sys.exit(0)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mapping_of(ptr):
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, _, hi = line.split()[0].partition("-")
        if int(lo, 16) <= ptr < int(hi, 16):
            return int(lo, 16), int(hi, 16)
    return None

def own_mapping(ptr):  # glibc's chunk header, the word before the block: IS_MMAPPED (0x2)
    return bool(ctypes.c_size_t.from_address(ptr - ctypes.sizeof(ctypes.c_size_t)).value & 2)

size = 28 << 20
with loading_heap() as took:
    during = libc.malloc(size)
    print("during", took, own_mapping(during))
    libc.free(during)
    print("freed", mapping_of(during) is None)
after = libc.malloc(size)
print("after", own_mapping(after))
"""


def test_a_large_temporary_is_a_mapping_of_its_own_returned_whole_only_while_loading():
    out = subprocess.run([sys.executable, "-c", _LOADING_HEAP_PROBE], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))).stdout.split("\n")
    if out[0] == "not glibc":
        pytest.skip("not glibc: loading_heap does nothing")
    # While loading: a mapping of its own, unmapped when freed. After: under the serving threshold
    # (32 MiB), so in an arena, as glibc's dynamic threshold would have it after loading's temporaries.
    assert out[:3] == ["during True True", "freed True", "after False"], out
