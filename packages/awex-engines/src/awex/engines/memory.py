"""The peak extra memory of this process during a piece of work, measured from the process itself.

CUDA and NPU: the device allocator's peak (``max_memory_allocated`` after ``reset_peak_memory_stats``) minus
what was allocated before. CPU: the kernel's resident-set high-water mark (``VmHWM``, reset by writing ``5`` to
``/proc/self/clear_refs``) minus the resident set before. Linux only for CPU; elsewhere ``None``.
"""

from __future__ import annotations

import torch

from awex.transport.accelerator import device_api, is_accelerator


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.extra_bytes`` (``None`` where it cannot be measured)."""

    def __init__(self, device: torch.device | str | None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.extra_bytes: int | None = None
        self._before: int | None = None

    def __enter__(self) -> "PeakMemory":
        if is_accelerator(self.device):  # CUDA or NPU: the device allocator's own peak
            api = device_api(self.device)
            api.synchronize(self.device)
            api.reset_peak_memory_stats(self.device)
            self._before = api.memory_allocated(self.device)
            return self
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak resident set to the current one
        except OSError:
            return self
        rss = _status_kib("VmRSS")
        self._before = None if rss is None else rss * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self._before is None:
            return
        if is_accelerator(self.device):
            api = device_api(self.device)
            api.synchronize(self.device)
            peak = api.max_memory_allocated(self.device)
        else:
            hwm = _status_kib("VmHWM")
            if hwm is None:
                return
            peak = hwm * 1024
        self.extra_bytes = max(0, peak - self._before)
