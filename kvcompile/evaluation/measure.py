"""What a benchmark records besides its answers: peak memory of a step, and the machine it ran on."""

from __future__ import annotations

import ctypes
import platform
import time
from pathlib import Path

import torch
import transformers


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


class PeakMemory:
    """Peak memory of a block above the memory in use before it, in MiB: on a CUDA `device` what torch's allocator
    handed out there; else resident memory (Linux with glibc; `mib` is None elsewhere), a resident-set measure where
    pages the allocator keeps from earlier steps hide part of a step's use, so small differences are noise."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.mib: float | None = None
        self._clear_refs = Path("/proc/self/clear_refs")
        self._libc = _libc()
        self._cuda = device if device is not None and device.type == "cuda" else None

    def __enter__(self) -> PeakMemory:
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
            torch.cuda.reset_peak_memory_stats(self._cuda)
            self._before = torch.cuda.memory_allocated(self._cuda)
            return self
        self._enabled = self._clear_refs.exists() and self._libc is not None
        if self._enabled:
            self._libc.malloc_trim(0)  # return freed heap pages first, or reused pages would not show as new
            self._clear_refs.write_text("5")  # resets VmHWM to the current VmRSS
            self._before = _status_kib("VmRSS")
        return self

    def seconds_since(self, started: float) -> float:
        """Seconds from `started` (time.perf_counter) to now, once the GPU work queued so far has finished."""
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
        return time.perf_counter() - started

    def __exit__(self, *exc: object) -> None:
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
            self.mib = (torch.cuda.max_memory_allocated(self._cuda) - self._before) / 2**20
        elif self._enabled:
            self.mib = (_status_kib("VmHWM") - self._before) / 1024


def machine() -> str:
    cpu = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    device = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    return (
        f"{platform.node()}: {cpu}{device}, {torch.get_num_threads()} torch threads, Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )
