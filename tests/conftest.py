"""Suite-wide: the report header names the CPU kernels the numeric tests ran on.

Numeric results (greedy equality, int8 bounds, sampler statistics) depend on which kernels torch
picks for this CPU (AVX2, AVX-512, AMX) and on ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA when set;
a CI log must say which."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 - pytest's TerminalReporter
    # In the summary, not the header: `make test` runs with -q, which hides the header.
    terminalreporter.write_line(_kernels())


def _kernels() -> str:
    try:
        import torch

        from magnitude.runner.quant_eval import isa_description
    except ImportError as exc:  # the engine extra is not installed: no numeric tests run
        return f"CPU kernels: unknown ({exc})"
    return f"CPU kernels: {isa_description()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
