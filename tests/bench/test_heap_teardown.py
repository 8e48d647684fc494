"""bench/heap_teardown.py: a real process SIGKILLed while holding a heap; its socket's end is read."""

import os

import pytest

from phalanx.bench.heap_teardown import measure
from phalanx.train.host_memory import worker_hugepage_env


def test_a_killed_process_is_timed_to_the_end_of_its_stream() -> None:
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    seconds, _ = measure(0.125, plain)
    assert 0 < seconds < 10


@pytest.mark.skipif(not worker_hugepage_env({})[0], reason="no transparent huge pages for glibc's malloc here")
def test_the_huge_page_variant_really_holds_huge_pages() -> None:
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    _, huge_kib = measure(0.125, {**plain, **worker_hugepage_env(plain)[0]})
    assert huge_kib >= 64 * 1024  # most of the 128 MiB
