"""Store connections made ahead of need (``StoreSpares``): a group build takes a ready one and a
new one is made on a thread of its own, so a slow connect (torch's client waits on a reverse DNS
lookup before each connect) is not on a new quorum's path."""

import threading
import time

import pytest

from phalanx.collectives.store_spares import StoreSpares


class _Connects:
    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.delay_s, self.fail = delay_s, fail
        self.threads: list[str] = []
        self.n = 0
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self) -> str:
        self.gate.wait(5.0)
        time.sleep(self.delay_s)
        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("connection refused")
        self.n += 1
        return f"client{self.n}"


def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_take_gets_a_ready_spare_and_the_next_is_made_on_another_thread() -> None:
    connect = _Connects(delay_s=0.05)
    spares = StoreSpares(connect)
    spares.offer("joined")
    t0 = time.monotonic()
    assert spares.take() == "joined"
    assert time.monotonic() - t0 < 0.04, "the take did not wait for the refill's connect"
    _until(lambda: spares.ready == 1)
    assert connect.threads == ["phalanx-store-spare"]
    assert spares.take() == "client1" and spares.connects_on_demand == 0


def test_with_no_spare_ready_a_take_connects_itself() -> None:
    connect = _Connects()
    connect.gate.clear()  # the refill's connect is held up
    spares = StoreSpares(connect)
    got: list[str] = []
    taker = threading.Thread(target=lambda: got.append(spares.take()), name="build")
    taker.start()
    time.sleep(0.05)
    connect.gate.set()
    taker.join(5.0)
    assert got and spares.connects_on_demand == 1 and "build" in connect.threads


def test_discard_drops_the_spares_and_a_refill_already_under_way() -> None:
    connect = _Connects()
    connect.gate.clear()
    spares = StoreSpares(connect)
    spares.offer("old")
    assert spares.take() == "old"  # starts a refill, held at the gate
    spares.discard()
    connect.gate.set()
    _until(lambda: len(connect.threads) == 1)
    time.sleep(0.02)
    assert spares.ready == 0, "a connection made before the discard is not kept"


def test_a_failed_refill_is_quiet_and_the_next_take_says_why() -> None:
    connect = _Connects(fail=True)
    spares = StoreSpares(connect)
    spares.refill()
    _until(lambda: len(connect.threads) == 1)
    with pytest.raises(RuntimeError, match="connection refused"):
        spares.take()


def test_the_factory_keeps_its_join_check_connection_for_the_first_group() -> None:
    from phalanx.collectives.process_group import RendezvousStore, TorchProcessGroupFactory

    store = RendezvousStore("127.0.0.1")
    try:
        factory = TorchProcessGroupFactory(store.address, b"t" * 32, run_id="spares")
        assert factory._spares.ready == 1
        signed = factory._store_for_group()
        signed.set("k", b"v")
        assert bytes(signed.get("k")) == b"v" and factory._spares.connects_on_demand == 0
        _until(lambda: factory._spares.ready == 1)  # the next group's, made in the background
    finally:
        store.close()
