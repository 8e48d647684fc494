"""Sessions own the healthy and waiting counts: every change keeps them equal to a recount."""

import random

from phalanx.membership.sessions import Sessions, SuspicionCause, WorkerSession


class _Conn:
    peer = "x"
    is_closed = False

    def close(self, reason="closed"):
        pass


def _session(wid):
    return WorkerSession(wid, "inc", _Conn(), 1, "", 0.0, 0.0, -1, False)


def test_counts_follow_every_change_and_match_a_recount():
    rng = random.Random(3)
    ss = Sessions()
    for step in range(3000):
        wid = f"w{rng.randrange(8)}"
        s = ss.get(wid)
        op = rng.randrange(8)
        if s is None or op == 0:
            ss.admit(_session(wid))
        elif op == 1:
            ss.set_waiting(s, True, step)
        elif op == 2:
            ss.set_waiting(s, False)
        elif op == 3:
            ss.suspect(s, rng.choice(list(SuspicionCause)), "test")
        elif op == 4:
            ss.clear_suspicion(s, step)
        elif op == 5:
            ss.disconnect(s, step)
        elif op == 6:
            ss.finish(s)
        else:
            ss.prune(step, 5.0, frozenset())
        ss.check_counts()


def test_a_worker_suspected_while_asking_is_asking_again_when_it_comes_back():
    ss = Sessions()
    s = _session("w0")
    ss.admit(s)
    ss.set_waiting(s, True, 1.0)
    assert (ss.healthy_n, ss.waiting_n) == (1, 1)
    assert ss.suspect(s, SuspicionCause.NO_HEARTBEAT, "no heartbeat for 0.7 s")
    assert (ss.healthy_n, ss.waiting_n) == (0, 0) and not s.waiting
    ss.clear_suspicion(s, 2.0)
    assert (ss.healthy_n, ss.waiting_n) == (1, 1) and s.waiting


def test_a_replaced_incarnation_no_longer_counts():
    ss = Sessions()
    old = _session("w0")
    ss.admit(old)
    ss.set_waiting(old, True)
    assert ss.admit(_session("w0")) is old
    ss.set_waiting(old, False)  # a late change to the old incarnation changes nothing
    assert (ss.healthy_n, ss.waiting_n) == (1, 0)
    ss.check_counts()


def test_departed_finished_sessions_are_forgotten_but_not_members_of_the_current_quorum():
    ss = Sessions()
    for wid in ("w0", "w1", "w2"):
        ss.admit(_session(wid))
        ss.finish(ss[wid])
        ss.disconnect(ss[wid], 0.0)
    assert ss.prune(100.0, 60.0, frozenset({"w1"})) == ["w0", "w2"]
    assert "w1" in ss and len(ss) == 1
