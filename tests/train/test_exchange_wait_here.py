"""``Exchange.wait_here``: the body's thread waits for its collectives before the vote goes to the
loop, and stops when the step is lost or its deadline passes (fake collectives; the real Gloo
wait is in tests/collectives/test_wait_here.py)."""

import asyncio
import threading
import time

from phalanx.train.exchange import Exchange


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Slow:
    """Finishes after ``slices`` waits of the body's thread; each wait advances the clock by its slice."""

    def __init__(self, clock: _Clock, slices: int | None) -> None:
        self.clock, self.left, self.waits = clock, slices, 0

    def wait_here(self, slice_s: float) -> bool:
        self.waits += 1
        self.clock.t += slice_s
        if self.left is None:
            return False
        self.left -= 1
        return self.left <= 0

    async def wait(self, timeout_s: float) -> None:
        assert self.left is not None and self.left <= 0, "the loop is asked only once it is done here"


class _Group:
    quorum_id, rank, world_size = 1, 0, 2

    def __init__(self, pendings: list) -> None:
        self.pendings = list(pendings)

    def start_allreduce_sum(self, tensor, share=1.0):
        return self.pendings.pop(0)

    async def allreduce_sum(self, tensor, timeout_s):
        return None

    def abandon(self) -> None:
        pass


def test_waits_until_every_collective_is_done_and_counts_the_time():
    clock = _Clock()
    a, b = _Slow(clock, 3), _Slow(clock, 2)
    ex = Exchange(_Group([a, b]))
    ex.launch("bucket0")
    ex.launch("bucket1")
    ex.wait_here(lambda: False, 5.0, clock, slice_s=0.01)
    assert (a.waits, b.waits) == (3, 2)
    assert abs(ex.waited_s - 0.05) < 1e-9
    asyncio.run(ex.complete(5.0 - ex.waited_s, clock))  # finds them finished


def _hung_exchange(clock: _Clock) -> tuple[_Slow, Exchange]:
    """One bucket on the wire whose peer froze: it never finishes."""
    hung = _Slow(clock, None)
    ex = Exchange(_Group([hung]))
    ex.launch("bucket0")
    return hung, ex


def test_a_lost_step_stops_the_wait_between_slices():
    clock = _Clock()
    hung, ex = _hung_exchange(clock)
    lost_after = iter([False, False, False, True])  # looked at before the first slice too
    ex.wait_here(lambda: next(lost_after), 5.0, clock, slice_s=0.01)
    assert hung.waits == 3 and abs(ex.waited_s - 0.03) < 1e-9


def test_the_wait_ends_at_the_collective_deadline():
    clock = _Clock()
    hung, ex = _hung_exchange(clock)
    ex.wait_here(lambda: False, 0.5, clock, slice_s=0.125)
    assert hung.waits == 4 and ex.waited_s == 0.5


class _Deferring(_Group):
    def start_allreduce_sum(self, tensor, share=1.0):
        return None  # a network fault: the loop issues it


def test_queued_or_failed_exchanges_are_left_to_the_loop():
    clock = _Clock()
    ex = Exchange(_Deferring([]))
    ex.launch("bucket0")
    ex.wait_here(lambda: False, 5.0, clock)
    assert ex.waited_s == 0.0
    broken = Exchange(None, "no group")
    broken.wait_here(lambda: False, 5.0, clock)
    assert broken.waited_s == 0.0


def test_a_step_lost_before_the_wait_does_not_block_at_all():
    clock = _Clock()
    hung, ex = _hung_exchange(clock)
    ex.wait_here(lambda: True, 5.0, clock, slice_s=0.01)
    assert hung.waits == 0 and ex.waited_s == 0.0


class _Hung:
    """A real wait on a thread: a slice ends early only when woken (a frozen peer's collective)."""

    def __init__(self) -> None:
        self._bell = threading.Event()
        self.waits = 0

    def wait_here(self, slice_s: float) -> bool:
        self.waits += 1
        self._bell.wait(slice_s)
        self._bell.clear()
        return False

    def wake(self) -> None:
        self._bell.set()


def test_a_wake_from_another_thread_ends_the_wait_at_once():
    hung = _Hung()
    ex = Exchange(_Group([hung]))
    ex.launch("bucket0")
    lost = threading.Event()

    def break_the_quorum() -> None:
        time.sleep(0.1)
        lost.set()  # what the coordinator's QuorumBroken does on the control loop, then the wake
        ex.wake()

    threading.Thread(target=break_the_quorum).start()
    t0 = time.monotonic()
    ex.wait_here(lost.is_set, 30.0, time.monotonic, slice_s=10.0)
    assert time.monotonic() - t0 < 5.0, "the wake must end a 10 s slice"
    assert hung.waits == 1 and 0.05 < ex.waited_s < 5.0
