"""Magnitude's own CPU kernels for low-bit weights (`lowbit_kernels.c`): building, caching, loading
and calling them.

A small decode batch multiplies a few activation rows by every weight once. torch's int4 and int8
weight-only CPU kernels decode the weights again for each row and, on their fast path, round the
activations to bf16; `lowbit_kernels.c` decodes each weight block once for up to 8 rows and keeps
the activations in fp32 (measured with `bench/lowbit_bench.py`); the fused decode step
(fused_decode.py) runs whole decoder layers on them, a bfloat16 model's too. quantize.py's w4a16 and w8a16
linears call these kernels where they load and fall back to torch's where not; w4a8's (int4 weights
times int8-rounded activations, integer dot products) and w4a16-int16's (the same with int16)
exist only here, so those two are refused where they do not load.

The C source is compiled at first use with the system C compiler for this CPU (`-march=native`,
OpenMP) into `$MAGNITUDE_CACHE/kernels/lowbit-<key>.so`, the key hashing the source, the compiler,
the flags and the CPU (its model and feature flags, and what `-march=native` resolves to), so pods
of different CPUs sharing a cache volume each get their own build. A build takes about a second. No compiler, or a failed build,
means torch's kernels, logged once. `MAGNITUDE_LOWBIT_KERNEL=torch` keeps torch's kernels;
`=native` makes a missing build an error (tests compare the two). On a CPU with AMX (built with
`-march=native`, Linux granting the tile state) w4a16-bf16prefill's bf16 products run on AMX tiles;
`MAGNITUDE_LOWBIT_AMX=0` keeps them on AVX512-BF16 (the same operands, other sums' order; the
kernels' name says `-amx`, and so do the cache keys and records of w4a16-bf16prefill, the only method
whose products change with it: `describe(bf16_products=False)` leaves it out for the others).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from magnitude.runner.model_cache import cache_root

log = logging.getLogger(__name__)

KERNEL_ENV = "MAGNITUDE_LOWBIT_KERNEL"
AMX_ENV = "MAGNITUDE_LOWBIT_AMX"
SOURCE = Path(__file__).with_name("lowbit_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)
# Every layout works on groups of 32 input channels (int4's and int8g's quantization groups; int8's vector width).
K_MULTIPLE = 32



class LowbitKernelError(RuntimeError):
    """`MAGNITUDE_LOWBIT_KERNEL=native` was asked for and the kernels could not be built or loaded."""


@dataclass(frozen=True)
class LowbitKernels:
    """The loaded library. Every tensor argument is CPU, contiguous, in the dtype named."""

    lib: ctypes.CDLL
    isa: str  # "avx512", "avx2" or "generic": which code path the build took
    path: Path

    @property
    def amx(self) -> bool:
        """Whether the bf16 products run on AMX tiles now (load(): MAGNITUDE_LOWBIT_AMX, the build, the OS)."""
        return bool(self.lib.magnitude_lowbit_amx())

    @property
    def name(self) -> str:
        return f"magnitude-{self.isa}{'-amx' if self.amx else ''}"

    def int4_matmul(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    mins: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 @ W^T -> [M, N] fp32; W as codes [N, K/2] uint8, scales/mins [N, K/32] fp32."""
        m, k = x.shape
        if k % K_MULTIPLE or codes.shape[1] * 2 != k:
            raise ValueError(f"int4 product: x has {k} columns, the weights {codes.shape[1] * 2} (a multiple of 32)")
        y = torch.empty(m, codes.shape[0], dtype=torch.float32)
        self.lib.magnitude_int4_matmul(x.data_ptr(), m, k, codes.shape[0], codes.data_ptr(), scales.data_ptr(),
                                       mins.data_ptr(), y.data_ptr(), torch.get_num_threads())
        return y

    @property
    def bf16(self) -> bool:
        """Whether this build has the bf16 products for prompt rows (the CPU has AVX512-BF16)."""
        return bool(self.lib.magnitude_lowbit_bf16())

    def int4_bf16_matmul(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                         rows: np.ndarray) -> torch.Tensor:
        """As `int4_matmul`, with the rows `rows` marks (uint8 [M]) rounded to bf16 and multiplied by
        the weights rounded to bf16, sums in fp32 (w4a16-bf16prefill's prompt rows); the others exact."""
        m, k = x.shape
        if k % K_MULTIPLE or codes.shape[1] * 2 != k:
            raise ValueError(f"int4 product: x has {k} columns, the weights {codes.shape[1] * 2} (a multiple of 32)")
        if rows.dtype != np.uint8 or rows.shape != (m,):
            raise ValueError(f"bf16 rows: expected uint8 [{m}], got {rows.dtype} {list(rows.shape)}")
        y = torch.empty(m, codes.shape[0], dtype=torch.float32)
        rows = np.ascontiguousarray(rows)
        rc = self.lib.magnitude_int4_bf16_matmul(x.data_ptr(), m, k, codes.shape[0], codes.data_ptr(),
                                                 scales.data_ptr(), mins.data_ptr(), y.data_ptr(), rows.ctypes.data,
                                                 torch.get_num_threads())
        if rc == -2:
            raise LowbitKernelError(f"bf16 products: this build ({self.path.name}) has none (no AVX512-BF16)")
        if rc:
            raise MemoryError(f"int4 bf16 product: no memory for {m} x {k} bf16 activations")
        return y

    def int4q8_matmul(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      mins: torch.Tensor) -> torch.Tensor:
        """As `int4_matmul`, with x's rows first quantized to int8 per group of 32 inputs
        (`q8_activations` gives the same rounding in torch): the w4a8 product."""
        return self._int4_quantized(self.lib.magnitude_int4q8_matmul, "int8", x, codes, scales, mins)

    def int4q16_matmul(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                       mins: torch.Tensor) -> torch.Tensor:
        """As `int4_matmul`, with x's rows first quantized to int16 per group of 32 inputs
        (`q16_activations` gives the same rounding in torch): the w4a16-int16 product."""
        return self._int4_quantized(self.lib.magnitude_int4q16_matmul, "int16", x, codes, scales, mins)

    @staticmethod
    def _int4_quantized(product: ctypes._CFuncPtr, kind: str, x: torch.Tensor, codes: torch.Tensor,
                        scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        if k % K_MULTIPLE or codes.shape[1] * 2 != k:
            raise ValueError(f"int4 product: x has {k} columns, the weights {codes.shape[1] * 2} (a multiple of 32)")
        y = torch.empty(m, codes.shape[0], dtype=torch.float32)
        if product(x.data_ptr(), m, k, codes.shape[0], codes.data_ptr(), scales.data_ptr(), mins.data_ptr(),
                   y.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"int4 x {kind} product: no memory for {m} x {k} {kind} activations")
        return y

    def int8_matmul(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 @ W^T -> [M, N] fp32; W as codes [N, K] int8 times scales [N] fp32."""
        m, k = x.shape
        if k % K_MULTIPLE or codes.shape[1] != k:
            raise ValueError(f"int8 product: x has {k} columns, the weights {codes.shape[1]} (a multiple of 32)")
        y = torch.empty(m, codes.shape[0], dtype=torch.float32)
        self.lib.magnitude_int8_matmul(x.data_ptr(), m, k, codes.shape[0], codes.data_ptr(), scales.data_ptr(),
                                       y.data_ptr(), torch.get_num_threads())
        return y

    def int8g_matmul(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 @ W^T -> [M, N] fp32; W as codes [N, K] int8 times scales [N, K/32] fp32,
        one per group of 32 inputs (GGUF Q8_0's blocks)."""
        m, k = x.shape
        self._int8g_shapes(x, codes, scales)
        y = torch.empty(m, codes.shape[0], dtype=torch.float32)
        self.lib.magnitude_int8g_matmul(x.data_ptr(), m, k, codes.shape[0], codes.data_ptr(), scales.data_ptr(),
                                        y.data_ptr(), torch.get_num_threads())
        return y

    def int8gq16_matmul(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """As `int8g_matmul`, with x's rows first quantized to int16 per group of 32 inputs
        (`q16_activations`) and integer dot products: w4a16-int16's LM head."""
        m, k = x.shape
        self._int8g_shapes(x, codes, scales)
        y = torch.empty(m, codes.shape[0], dtype=torch.float32)
        if self.lib.magnitude_int8gq16_matmul(x.data_ptr(), m, k, codes.shape[0], codes.data_ptr(), scales.data_ptr(),
                                              y.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"int8g x int16 product: no memory for {m} x {k} int16 activations")
        return y

    @staticmethod
    def _int8g_shapes(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        k = x.shape[1]
        if k % K_MULTIPLE or codes.shape[1] != k or scales.shape[-1] * K_MULTIPLE != k:
            raise ValueError(f"int8g product: x has {k} columns, the weights {codes.shape[1]} and "
                             f"{scales.shape[-1]} scales a row (a multiple of 32, one scale per 32)")

    def to_float16(self, x: torch.Tensor) -> torch.Tensor:
        """x (fp32, contiguous) rounded to float16 as the fused step stores K/V in a float16 pool."""
        out = torch.empty(x.shape, dtype=torch.float16)
        self.lib.magnitude_to_f16(x.data_ptr(), out.data_ptr(), x.numel())
        return out


def q8_activations(x: torch.Tensor, largest: float = 127.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (q [M, K] int8 values as fp32, d [M, K/32]): the rounding the w4a8 products
    apply to their input (lowbit_kernels.c `quantize_group`), figure for figure for finite x: per
    group of 32, d = max|x| / 127 (0 below FLT_MIN, where 1 / d would overflow) and
    q = round-half-even(x * (1 / d)), all in fp32. q * d is the activation the product multiplies;
    tests compare the kernels with it. (A non-finite x: NaN here; the kernels make the group's
    products NaN.) `largest` 32767: `q16_activations`."""
    m, k = x.shape
    g = x.float().reshape(m, k // K_MULTIPLE, K_MULTIPLE)
    d = g.abs().amax(dim=-1) / largest
    d = torch.where(d >= torch.finfo(torch.float32).tiny, d, torch.zeros_like(d))
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(g * inv[..., None])
    return q.reshape(m, k), d


def q16_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As `q8_activations` with int16's range, d = max|x| / 32767: the rounding w4a16-int16's
    products apply to a decode row's input."""
    return q8_activations(x, 32767.0)


# Which rows of the step being computed are prompt rows (uint8 per row of the flattened step; None:
# none), for the methods whose products treat them apart: w4a16-bf16prefill multiplies them in bf16,
# w4a16-int16 in fp32 as w4a16 does. The runner sets it around a step's forward: a linear sees only
# its input matrix, not which sequence a row belongs to.
_PROMPT_ROWS: ContextVar[np.ndarray | None] = ContextVar("magnitude_prompt_rows", default=None)


@contextmanager
def prompt_rows(rows: np.ndarray | None) -> Iterator[None]:
    """Within the block, products of `rows.size` rows take the rows it marks as prompt rows (where
    their linear is one of quantize.PROMPT_ROW_METHODS)."""
    token = _PROMPT_ROWS.set(rows)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)


def current_prompt_rows(m: int) -> np.ndarray | None:
    """The marked rows for a product of `m` rows: the step's, if it has that many and marks any."""
    rows = _PROMPT_ROWS.get()
    return rows if rows is not None and rows.shape == (m,) and rows.any() else None


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.magnitude_lowbit_isa.restype = ctypes.c_char_p
    lib.magnitude_lowbit_isa.argtypes = []
    lib.magnitude_int4_matmul.argtypes = [p, i64, i64, i64, p, p, p, p, i32]
    lib.magnitude_int8_matmul.argtypes = [p, i64, i64, i64, p, p, p, i32]
    lib.magnitude_int4_matmul.restype = None
    lib.magnitude_int4q8_matmul.argtypes = [p, i64, i64, i64, p, p, p, p, i32]
    lib.magnitude_int4q8_matmul.restype = ctypes.c_int
    lib.magnitude_int4q16_matmul.argtypes = [p, i64, i64, i64, p, p, p, p, i32]
    lib.magnitude_int4q16_matmul.restype = ctypes.c_int
    lib.magnitude_int8_matmul.restype = None
    lib.magnitude_int8g_matmul.argtypes = [p, i64, i64, i64, p, p, p, i32]
    lib.magnitude_int8g_matmul.restype = None
    lib.magnitude_int8gq16_matmul.argtypes = [p, i64, i64, i64, p, p, p, i32]
    lib.magnitude_int8gq16_matmul.restype = ctypes.c_int
    # (dims, layers, n_layers, h, m, positions, tables, cos, sin, final_norm, final_eps, threads):
    # runner/fused_decode.py
    lib.magnitude_decode_layers.argtypes = [p, p, i64, p, i64, p, p, p, p, p, ctypes.c_float, i32]
    lib.magnitude_decode_layers.restype = ctypes.c_int
    lib.magnitude_lowbit_bf16.restype = ctypes.c_int
    lib.magnitude_lowbit_bf16.argtypes = []
    lib.magnitude_int4_bf16_matmul.argtypes = [p, i64, i64, i64, p, p, p, p, p, i32]
    lib.magnitude_int4_bf16_matmul.restype = ctypes.c_int
    lib.magnitude_to_f16.argtypes = [p, p, i64]
    lib.magnitude_to_f16.restype = None
    lib.magnitude_lowbit_set_amx.argtypes = [i32]
    lib.magnitude_lowbit_set_amx.restype = ctypes.c_int
    lib.magnitude_lowbit_amx.argtypes = []
    lib.magnitude_lowbit_amx.restype = ctypes.c_int


def _cpu_identity() -> str:
    """The CPU's model name and feature flags: what `-march=native` compiles for."""
    wanted = ("model name", "flags", "Features", "CPU part")
    lines: list[str] = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.split(":", 1)[0].strip() in wanted and line not in lines:
                    lines.append(line)
                if not line.strip() and lines:
                    break  # the first processor's block describes them all
    except OSError:
        pass
    return platform.machine() + "\n" + "".join(lines)


def _native_target(cc: str) -> str:
    """What `-march=native` resolves to for this compiler on this CPU (its driver's verbose command
    lines name the CPU and its features), so a build is never reused on another CPU even where
    /proc/cpuinfo cannot be read; empty if the driver does not say."""
    try:
        done = subprocess.run([cc, "-march=native", "-E", "-v", "-"], input="", capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return "\n".join(line for line in done.stderr.splitlines() if "march" in line or "target-cpu" in line)


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(directory: Path | None = None, flags: tuple[str, ...] = FLAGS) -> Path:
    """Compile the kernels for this CPU (or find the cached build) and return the library's path.
    Raises LowbitKernelError naming what failed."""
    cc = _compiler()
    if cc is None:
        raise LowbitKernelError("no C compiler found (looked for $CC, cc, gcc, clang)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise LowbitKernelError(f"{cc} --version failed: {e}") from e
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(),
                                     _cpu_identity().encode(), _native_target(cc).encode()])).hexdigest()[:24]
    directory = directory or cache_root() / "kernels"
    target = directory / f"lowbit-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Built under a name of its own and renamed: processes sharing the volume never load half a file.
    tmp = directory / f".lowbit-{key}.{os.getpid()}.{threading.get_ident()}.so"
    cmd = [cc, *flags, "-o", str(tmp), str(SOURCE), *LIBS]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        tmp.unlink(missing_ok=True)
        raise LowbitKernelError(f"{' '.join(cmd)} failed: {e}") from e
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise LowbitKernelError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, target)
    log.info("built the low-bit kernels for this CPU: %s", target)
    return target


def load(path: Path) -> LowbitKernels:
    """The library at `path`, its bf16 products on AMX tiles where the build has them, Linux grants
    the tile state and MAGNITUDE_LOWBIT_AMX is 1 or unset (0 keeps them off; anything else is
    refused). The choice is process-wide: the last load's."""
    choice = _amx_choice()
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    lib.magnitude_lowbit_set_amx(choice == "1")
    return LowbitKernels(lib, lib.magnitude_lowbit_isa().decode(), path)


def _amx_choice() -> str:
    choice = os.environ.get(AMX_ENV, "1")
    if choice not in ("0", "1"):
        raise LowbitKernelError(f"{AMX_ENV}={choice!r}: expected 0 or 1")
    return choice


_lock = threading.Lock()
_loaded: LowbitKernels | None = None
_failure: str | None = None


def kernels() -> LowbitKernels | None:
    """The kernels for this process (built once), or None where torch's kernels are to be used:
    `MAGNITUDE_LOWBIT_KERNEL=torch`, or the build failed (logged once with the reason)."""
    global _loaded, _failure
    choice = os.environ.get(KERNEL_ENV, "")
    if choice not in ("", "native", "torch"):
        raise LowbitKernelError(f"{KERNEL_ENV}={choice!r}: expected native or torch")
    if choice == "torch":
        return None
    _amx_choice()  # a bad value is an error, not a build failure that falls back to torch's kernels
    with _lock:
        if _loaded is None and _failure is None:
            try:
                _loaded = load(build())
            except (LowbitKernelError, OSError) as e:
                _failure = str(e)
                log.warning("Magnitude's kernels did not build (low-bit weights use torch's, bf16 models the lean "
                            "forward): %s", _failure)
        if _loaded is None and choice == "native":
            raise LowbitKernelError(f"{KERNEL_ENV}=native: {_failure}")
        return _loaded


def describe(bf16_products: bool = True) -> str:
    """Which kernels low-bit weights run on, for logs, cache keys and test output: Magnitude's with
    their build's key (source, compiler, flags, CPU), so a quantization record or step-cost table
    measured on other kernel code is not reused; or torch's, and why. `bf16_products=False` (a
    method that never runs them) leaves out whether they are on AMX tiles: that method's products
    are the same either way, so its records and tables stay valid when MAGNITUDE_LOWBIT_AMX flips."""
    if os.environ.get(KERNEL_ENV) == "torch":
        return f"torch ({KERNEL_ENV}=torch)"
    k = kernels()
    if k is None:
        return f"torch ({_failure})"
    name = k.name if bf16_products else k.name.removesuffix("-amx")
    return f"{name} build {k.path.stem.removeprefix('lowbit-')[:12]}"
