"""glibc's malloc, set once for a training process, so large tensors stop page-faulting every step.

glibc serves an allocation at or above ``M_MMAP_THRESHOLD`` (128 KiB at start) with a fresh mmap,
and gives the top of its heap back to the OS once more than ``M_TRIM_THRESHOLD`` of it is free. Both
move by themselves: freeing an mmapped block of up to 32 MiB raises the threshold to its size (and
the trim threshold to twice that). So how many pages a step faults in depends on which large blocks
the process happened to free first. Measured here (mlp-6m, 2 workers, AdamW on CPU): one phalanx
worker faulted ~7,900 pages a step (31 MB: the optimizer's temporaries, mapped and unmapped again
every step), 33 ms of a 110 ms step in the kernel, while the other worker, which had received the
healed state (one large block freed), faulted almost none; DDP's ranks free a large broadcast
buffer at start and fault none. Every rank then waits for the slowest one in the all-reduce.

``tune_for_tensors`` sets both thresholds up front, above the largest parameter (its gradient and
the optimizer's temporaries are that size): what glibc's own rule converges to, without the luck.
It leaves a process alone that is not on glibc, that sets ``MALLOC_*`` itself, preloads another
allocator, or sets ``PHALANX_MALLOC=off``. The cost: up to the trim threshold of freed memory stays
mapped in the process instead of going back to the OS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
GLIBC_DYNAMIC_MAX_BYTES = 32 * 1024 * 1024  # the most glibc's own rule raises the threshold to (64-bit)


@dataclass(frozen=True)
class MallocPlan:
    mmap_threshold_bytes: int
    trim_threshold_bytes: int


def plan_for(largest_tensor_bytes: int) -> MallocPlan:
    """Thresholds for tensors up to ``largest_tensor_bytes``: blocks of that size come from the heap
    (mmap only above twice it, or above glibc's own 32 MiB ceiling), and the heap keeps twice the
    threshold free before trimming, as glibc's dynamic rule does."""
    mmap_bytes = max(GLIBC_DYNAMIC_MAX_BYTES, 2 * max(0, largest_tensor_bytes))
    return MallocPlan(mmap_bytes, 2 * mmap_bytes)


def skip_reason(env: Mapping[str, str], libc_name: str) -> str:
    """Why this process's allocator is left alone ('' to tune it)."""
    if env.get("PHALANX_MALLOC", "").lower() in {"off", "0", "no", "false"}:
        return "PHALANX_MALLOC=off"
    if libc_name != "glibc":
        return f"not glibc ({libc_name or 'unknown libc'})"
    own = sorted(k for k in env if k.startswith("MALLOC_") and k.endswith("_"))
    if own:
        return f"{own[0]} is set: the process tunes malloc itself"
    if any(a in env.get("LD_PRELOAD", "") for a in ("jemalloc", "tcmalloc", "mimalloc")):
        return "another allocator is preloaded"
    return ""


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = getattr(ctypes.CDLL(name), "mallopt", None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


_applied: MallocPlan | None = None


def tune_for_tensors(largest_tensor_bytes: int, env: Mapping[str, str] | None = None,
                     mallopt: Callable[[int, int], int] | None = None) -> str:
    """Apply ``plan_for(largest_tensor_bytes)`` to this process (raising only, never lowering what an
    earlier call set). Returns what was done, in words, for the worker's log."""
    global _applied
    why = skip_reason(os.environ if env is None else env, platform.libc_ver()[0] if mallopt is None else "glibc")
    if why:
        return f"malloc left as it is: {why}"
    plan = plan_for(largest_tensor_bytes)
    if _applied is not None and plan.mmap_threshold_bytes <= _applied.mmap_threshold_bytes:
        return "malloc already tuned"
    fn = mallopt if mallopt is not None else _glibc_mallopt()
    if fn is None:
        return "malloc left as it is: no mallopt in this libc"
    if plan.trim_threshold_bytes >= 2**31:  # mallopt takes an int: very large models keep glibc's rule
        return "malloc left as it is: thresholds past mallopt's range"
    if not (fn(M_MMAP_THRESHOLD, plan.mmap_threshold_bytes) and fn(M_TRIM_THRESHOLD, plan.trim_threshold_bytes)):
        return "malloc left as it is: mallopt refused the thresholds"
    _applied = plan
    return (f"malloc: mmap threshold {plan.mmap_threshold_bytes >> 20} MiB, "
            f"trim threshold {plan.trim_threshold_bytes >> 20} MiB")


def tune_for_parameters(params: Iterable[Any]) -> str:
    """``tune_for_tensors`` for the largest CPU tensor among ``params`` (a model's parameters);
    a model with none on the CPU leaves malloc alone (its temporaries are the GPU's)."""
    cpu_bytes = [p.numel() * p.element_size() for p in params if p.device.type == "cpu"]
    return tune_for_tensors(max(cpu_bytes)) if cpu_bytes else "malloc left as it is: no CPU parameters"
