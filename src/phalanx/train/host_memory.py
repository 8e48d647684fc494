"""glibc's malloc, set once for a training process, so large tensors stop page-faulting every step;
and the workers' heap on transparent huge pages, so a killed worker's connections close sooner
(``hugepage_env``, set by the launcher: see the section at the end).

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


# ---- the heap on transparent huge pages: a killed worker's sockets close sooner ----
# A SIGKILLed process frees its memory before its file descriptors (the kernel's do_exit: exit_mm,
# then exit_files), so its peers and the coordinator read its closed connection only once every
# page is unmapped. On 4 KiB pages that is 55-70 ms a GiB on this machine (4 GiB: 220-250 ms idle,
# longer with the cores busy); on 2 MiB pages, a third (0.25 GiB) to an eighth (4 GiB) of that
# (docs/BENCHMARKS.md, session 35).
# glibc >= 2.35 puts its heap and mmapped blocks on transparent huge pages with this tunable (older
# ones ignore a tunable they do not know). It is read at process start, so the launcher sets it in
# the environment of the workers it starts (runtime/launcher.py).
HUGETLB_TUNABLE = "glibc.malloc.hugetlb"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode (always, madvise, never), '' where it has none."""
    try:
        text = open(path, encoding="ascii").read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def hugepage_env(env: Mapping[str, str], libc_name: str, mode: str) -> tuple[dict[str, str], str]:
    """What to add to a worker's environment so its malloc uses transparent huge pages, and why,
    in words. Nothing where the process's allocator is left alone (``skip_reason``), where the
    environment already sets ``glibc.malloc.hugetlb`` (the user's choice stands), or where the
    kernel has no huge pages to give (``mode`` never or unknown). Other tunables are kept."""
    why = skip_reason(env, libc_name)
    if why:
        return {}, f"heap pages left as they are: {why}"
    current = env.get("GLIBC_TUNABLES", "")
    if HUGETLB_TUNABLE in current:
        return {}, f"heap pages left as they are: GLIBC_TUNABLES sets {HUGETLB_TUNABLE} already"
    if mode not in ("always", "madvise"):
        return {}, f"heap pages left as they are: transparent huge pages are {mode or 'not available'}"
    tunables = f"{current}:{HUGETLB_TUNABLE}=1" if current else f"{HUGETLB_TUNABLE}=1"
    return {"GLIBC_TUNABLES": tunables}, f"heap on transparent huge pages ({HUGETLB_TUNABLE}=1)"


def worker_hugepage_env(env: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """``hugepage_env`` for this machine (Linux and glibc only)."""
    if platform.system() != "Linux":
        return {}, "heap pages left as they are: not Linux"
    return hugepage_env(env, platform.libc_ver()[0], thp_mode())


def heap_on_huge_pages(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process started with its malloc on transparent huge pages (for its log)."""
    return f"{HUGETLB_TUNABLE}=1" in (os.environ if env is None else env).get("GLIBC_TUNABLES", "")
