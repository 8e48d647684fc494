"""The virtual-time loop's timer semantics, as the simulator relies on them: timers run in (when,
seeded draw) order, replayably; a cancelled timer never runs and never moves the clock; a due timer
never runs before its time; callbacks run in the context they were scheduled with; errors reach the
exception handler; stop() inside an instant's timers loses none of them."""

import asyncio
import contextvars
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.sim.loop import SimDeadlock, VirtualTimeLoop, run_virtual


def _expected_order(seed: int, whens: list[float], cancelled: set[int]) -> list[int]:
    """The specification: one draw from Random(f"loop:{seed}") per timer, in scheduling order; timers
    run by when, then draw, then scheduling order."""
    rng = random.Random(f"loop:{seed}")
    keys = [(w, rng.random(), i) for i, w in enumerate(whens)]
    return [i for _, _, i in sorted(keys) if i not in cancelled]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), whens=st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.5, 3.0]), min_size=1, max_size=40),
       cancel_mask=st.lists(st.booleans(), min_size=40, max_size=40))
def test_timers_run_by_time_then_seeded_draw_and_cancelled_ones_never_run(seed, whens, cancel_mask):
    ran: list[int] = []
    cancelled = {i for i in range(len(whens)) if cancel_mask[i]}

    async def main():
        loop = asyncio.get_running_loop()
        handles = [loop.call_at(w, ran.append, i) for i, w in enumerate(whens)]
        for i in cancelled:
            handles[i].cancel()
            assert handles[i].cancelled()
        await asyncio.sleep(10)

    run_virtual(main(), seed)
    assert ran == _expected_order(seed, whens, cancelled)


def test_a_timer_cancelled_by_an_earlier_timer_of_the_same_instant_does_not_run():
    for seed in range(20):
        ran: list[str] = []

        async def main():
            loop = asyncio.get_running_loop()
            handles: dict[str, asyncio.TimerHandle] = {}

            def first(name: str) -> None:
                ran.append(name)
                other = "b" if name == "a" else "a"
                handles[other].cancel()

            handles["a"] = loop.call_later(1.0, first, "a")
            handles["b"] = loop.call_later(1.0, first, "b")
            await asyncio.sleep(2)

        run_virtual(main(), seed)
        assert len(ran) == 1, (seed, ran)


def test_the_clock_never_jumps_to_a_cancelled_timer():
    async def main():
        loop = asyncio.get_running_loop()
        loop.call_at(5.0, lambda: None).cancel()
        seen = []
        loop.call_at(7.0, lambda: seen.append(loop.time()))
        await asyncio.sleep(8)
        return seen

    seen, _ = run_virtual(main())
    assert seen == [7.0]

    async def only_cancelled():
        loop = asyncio.get_running_loop()
        loop.call_at(5.0, lambda: None).cancel()
        await loop.create_future()

    with pytest.raises(SimDeadlock, match="t=0.000000"):
        run_virtual(only_cancelled())


def test_a_due_timer_never_runs_before_its_time_and_time_never_goes_back():
    rng = random.Random(3)
    whens = [rng.uniform(0, 2) for _ in range(300)] + [1.0 + k * 1e-10 for k in range(5)]
    early: list[tuple[float, float]] = []
    clock: list[float] = []

    async def main():
        loop = asyncio.get_running_loop()

        def check(when: float) -> None:
            if loop.time() < when:
                early.append((loop.time(), when))
            clock.append(loop.time())

        for w in whens:
            loop.call_at(w, check, w)
        await asyncio.sleep(3)

    run_virtual(main())
    assert not early and len(clock) == len(whens) and clock == sorted(clock)


def test_many_cancelled_timers_are_compacted_and_the_live_ones_still_run_in_order():
    ran: list[int] = []

    async def main():
        loop = asyncio.get_running_loop()
        handles = [loop.call_later(1.0 + i * 1e-3, ran.append, i) for i in range(5000)]
        for i, h in enumerate(handles):
            if i % 10:
                h.cancel()
        loop.call_later(0.5, lambda: None)  # an iteration after the cancels, before any of them is due
        await asyncio.sleep(0.6)
        sizes.append(len(loop._instants))
        await asyncio.sleep(10)

    sizes: list[int] = []
    run_virtual(main())
    assert ran == list(range(0, 5000, 10))
    assert sizes[0] < 1000  # 4,500 cancelled instants dropped before their time


def test_a_callback_runs_in_the_context_it_was_scheduled_with():
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="loop")
    seen: list[tuple[str, str]] = []

    async def main():
        loop = asyncio.get_running_loop()
        token = var.set("scheduler")
        loop.call_later(1.0, lambda: seen.append(("later", var.get())))
        loop.call_soon(lambda: seen.append(("soon", var.get())))
        var.reset(token)
        other = contextvars.copy_context()
        other.run(var.set, "given")
        loop.call_later(1.0, lambda: seen.append(("later-given", var.get())), context=other)
        loop.call_soon(lambda: seen.append(("soon-given", var.get())), context=other)
        # a callback that sets a variable changes only its own context
        loop.call_soon(var.set, "leak")
        await asyncio.sleep(2)
        seen.append(("task", var.get()))

    run_virtual(main())
    assert sorted(seen) == sorted([("soon", "scheduler"), ("soon-given", "given"), ("later", "scheduler"),
                                   ("later-given", "given"), ("task", "loop")])


def test_errors_in_timer_and_ready_callbacks_reach_the_exception_handler():
    caught: list[str] = []

    def boom(what: str) -> None:
        raise ValueError(what)

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda lp, ctx: caught.append(str(ctx["exception"])))
        loop.call_later(1.0, boom, "timer")
        loop.call_soon(boom, "soon")
        loop.call_soon()  # no callback at all: a TypeError for the handler, not a crash of the loop
        await asyncio.sleep(2)
        return "still running"

    result, _ = run_virtual(main())
    assert result == "still running" and sorted(caught)[1:] == ["soon", "timer"]
    assert "missing" in sorted(caught)[0]


def test_stop_inside_an_instants_timers_keeps_the_rest_in_order_for_the_next_run():
    loop = VirtualTimeLoop(seed=4)
    ran: list[str] = []
    order = _expected_order(4, [1.0] * 4, set())

    def timer(i: int) -> None:
        ran.append(f"t{i}")
        if i == order[0]:
            loop.stop()
            loop.call_soon(ran.append, "soon")
        if i == order[1]:
            handles[order[2]].cancel()  # cancelled after it fell due, before it ran

    handles = [loop.call_at(1.0, timer, i) for i in range(4)]
    loop.run_forever()
    assert ran == [f"t{order[0]}"]

    async def rest():
        await asyncio.sleep(1)

    loop.run_until_complete(rest())
    assert ran == [f"t{order[0]}", f"t{order[1]}", f"t{order[3]}", "soon"]
    assert loop.timer_events == 4  # the three timers that ran and rest()'s sleep: a cancelled one is not counted
    loop.close()


def test_a_loop_stopped_before_it_runs_returns_after_one_round():
    loop = VirtualTimeLoop()
    ran: list[str] = []
    loop.call_soon(ran.append, "ready")
    loop.call_at(0.0, ran.append, "due now")
    loop.call_at(5.0, ran.append, "later")
    loop.stop()
    loop.run_forever()  # must return: nothing after the first round runs
    assert "later" not in ran and loop.time() == 0.0
    loop.close()
