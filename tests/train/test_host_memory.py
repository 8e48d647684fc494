"""train/host_memory.py: glibc's malloc set so a step's large temporaries stop page-faulting."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from phalanx.train import host_memory as hm

MiB = 1024 * 1024


def test_plan_keeps_tensors_of_the_largest_size_on_the_heap() -> None:
    assert hm.plan_for(7 * MiB) == hm.MallocPlan(32 * MiB, 64 * MiB)  # glibc's own ceiling is the floor
    assert hm.plan_for(100 * MiB) == hm.MallocPlan(200 * MiB, 400 * MiB)


@pytest.mark.parametrize("env, libc, why", [
    ({"PHALANX_MALLOC": "off"}, "glibc", "PHALANX_MALLOC=off"),
    ({}, "musl", "not glibc"),
    ({"MALLOC_TRIM_THRESHOLD_": "1"}, "glibc", "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "glibc", "another allocator"),
])
def test_a_process_that_chose_its_allocator_is_left_alone(env: dict[str, str], libc: str, why: str) -> None:
    assert why in hm.skip_reason(env, libc)
    assert hm.skip_reason({}, "glibc") == ""


def test_tuning_sets_both_thresholds_once_and_only_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hm, "_applied", None)
    calls: list[tuple[int, int]] = []
    ok = lambda k, v: calls.append((k, v)) or 1  # noqa: E731
    assert "32 MiB" in hm.tune_for_tensors(1 * MiB, env={}, mallopt=ok)
    assert calls == [(hm.M_MMAP_THRESHOLD, 32 * MiB), (hm.M_TRIM_THRESHOLD, 64 * MiB)]
    assert hm.tune_for_tensors(2 * MiB, env={}, mallopt=ok) == "malloc already tuned"
    assert "200 MiB" in hm.tune_for_tensors(100 * MiB, env={}, mallopt=ok)
    assert len(calls) == 4
    assert "refused" in hm.tune_for_tensors(500 * MiB, env={}, mallopt=lambda k, v: 0)
    assert "left as it is" in hm.tune_for_tensors(1 * MiB, env={"PHALANX_MALLOC": "off"}, mallopt=ok)


# A fresh process frees four 8 MiB blocks at once, then allocates them again, 20 times: glibc's own
# rule (mmap threshold raised to 8 MiB, trim at 16 MiB) hands the 32 MiB at the heap's top back to
# the OS each time and faults it in again; tuned, the pages stay.
_PROBE = textwrap.dedent("""
    import ctypes, ctypes.util, resource, sys
    from phalanx.train import host_memory
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    if sys.argv[1] == "tuned":
        print(host_memory.tune_for_tensors(8 << 20), file=sys.stderr)
    def round_():  # what a step's temporaries do: four 8 MiB blocks written, then freed together
        blocks = [libc.malloc(8 << 20) for _ in range(4)]
        for b in blocks:
            ctypes.memset(b, 1, 8 << 20)
        for b in blocks:
            libc.free(b)
    round_(); round_()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        round_()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")

@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_tuned_process_stops_faulting_its_large_temporaries() -> None:
    def faults(mode: str) -> int:
        env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MALLOC_")}
        out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                             env=env, timeout=120)
        return int(out.stdout.strip())

    pages_per_round = 4 * (8 << 20) // 4096
    assert faults("default") > 10 * pages_per_round  # the pathology, measured: every round faults in again
    assert faults("tuned") <= 2 * pages_per_round  # tuned: 0 or one round's pages in all 20 rounds


def test_the_largest_cpu_parameter_sets_the_plan_and_a_model_without_one_is_left_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    seen: list[int] = []
    monkeypatch.setattr(hm, "tune_for_tensors", lambda n: seen.append(n) or "tuned")
    assert hm.tune_for_parameters([torch.zeros(10), torch.zeros(3, 100)]) == "tuned" and seen == [1200]
    assert "no CPU parameters" in hm.tune_for_parameters([])


@pytest.mark.parametrize("env, libc, mode, added, why", [
    ({}, "glibc", "madvise", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "huge pages"),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "glibc", "always",
     {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}, "huge pages"),  # the user's kept
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "glibc", "madvise", {}, "sets glibc.malloc.hugetlb already"),
    ({}, "glibc", "never", {}, "transparent huge pages are never"),
    ({}, "glibc", "", {}, "not available"),
    ({"PHALANX_MALLOC": "off"}, "glibc", "madvise", {}, "PHALANX_MALLOC=off"),
    ({}, "musl", "madvise", {}, "not glibc"),
    ({"LD_PRELOAD": "libtcmalloc.so"}, "glibc", "madvise", {}, "another allocator"),
])
def test_workers_heap_goes_on_huge_pages_unless_someone_chose_otherwise(
        env: dict[str, str], libc: str, mode: str, added: dict[str, str], why: str) -> None:
    got, said = hm.hugepage_env(env, libc, mode)
    assert got == added and why in said
    assert hm.heap_on_huge_pages({**env, **got}) == bool(added)


def test_thp_mode_reads_the_bracketed_choice(tmp_path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hm.thp_mode(str(f)) == "madvise"
    assert hm.thp_mode(str(tmp_path / "missing")) == ""


@pytest.mark.skipif(not hm.worker_hugepage_env({})[0], reason="no transparent huge pages for glibc's malloc here")
def test_a_process_started_with_the_workers_environment_holds_its_tensors_on_huge_pages() -> None:
    probe = ("import torch\n"
             "t = torch.ones(16 * 2**20)  # 64 MiB\n"
             "print(sum(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages:')))\n")

    def huge_kib(extra: dict[str, str]) -> int:
        env = {k: v for k, v in __import__("os").environ.items() if k != "GLIBC_TUNABLES"}
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                             env={**env, **extra}, timeout=120)
        return int(out.stdout.strip())

    assert huge_kib(hm.worker_hugepage_env({})[0]) >= 32 * 1024  # most of the 64 MiB
    if hm.thp_mode() == "madvise":
        assert huge_kib({}) == 0  # without the tunable nothing asks for them
