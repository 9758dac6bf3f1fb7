"""`runner/file_pages.py`: pages of the checkpoint's mapping that quantized weights no longer read
are given back, a dropped page comes back from the file with its data, and anonymous memory is
never dropped (it would come back as zeros)."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from magnitude.runner.file_pages import drop_pages, file_backed_ranges  # noqa: E402

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


def test_pages_shared_with_a_neighbour_are_kept(tmp_path):
    """Only pages wholly inside the tensor: a tensor smaller than a page drops nothing, and its
    neighbour in the same file keeps its data."""
    path = tmp_path / "w.safetensors"
    tensors = {"a": torch.randn(100), "b": torch.randn(100)}
    safetensors_torch.save_file(tensors, path)
    loaded = safetensors_torch.load_file(path)
    assert drop_pages(loaded["a"], file_backed_ranges()) == 0
    assert torch.equal(loaded["b"], tensors["b"])
