"""The worker-side network-fault controller: routing, sides, lifting after for_s, what it learns."""

import asyncio
import random

from phalanx.core.messages import Bundle, InjectFault, QuorumAssigned, StepDecision
from phalanx.sim.loop import run_virtual
from phalanx.train.network_faults import NetworkFaults


class FakeHost:
    def __init__(self, name):
        self.name, self.rng, self.transport = name, random.Random(0), object()

    def now(self):
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds):
        await asyncio.sleep(seconds)

    def spawn(self, coro, name):
        return asyncio.ensure_future(coro)

    def log(self, event, **fields):
        pass


def test_network_faults_are_routed_here_and_lifted_after_for_s_others_go_on():
    async def main():
        host, logged, other = FakeHost("w2"), [], []
        net = NetworkFaults(host, "127.0.0.1:1", random.Random(0), log=lambda ev, **f: logged.append(ev))
        on_fault = net.route(other.append)
        on_fault(InjectFault(kind="straggler", factor=2.0))
        on_fault(InjectFault(kind="partition", for_s=2.0, groups=[["w0", "w1"], ["w2"]]))
        await asyncio.sleep(1.0)
        during = (net.conditions.side("w2"), net.conditions.reachable("coordinator"), net.conditions.reachable("w0"))
        await asyncio.sleep(1.5)
        after = net.conditions.reachable("coordinator")
        return [f.kind for f in other], during, after, logged

    (other, during, after, logged), _ = run_virtual(main())
    assert other == ["straggler"]
    assert during == (1, False, False) and after is True
    assert logged == ["network_fault_begin", "network_fault_end"]


def test_a_later_fault_of_the_same_kind_is_not_lifted_by_the_earlier_ones_timer():
    async def main():
        net = NetworkFaults(FakeHost("w0"), "127.0.0.1:1", random.Random(0))
        net.on_fault(InjectFault(kind="latency", for_s=1.0, mean_ms=10))
        await asyncio.sleep(0.5)
        net.on_fault(InjectFault(kind="latency", for_s=2.0, mean_ms=50, distribution="constant"))
        await asyncio.sleep(1.0)  # the first one's timer has fired
        still = net.conditions.message_delay_s("coordinator", lambda: 0, 0.0)
        await asyncio.sleep(1.0)
        return still, net.conditions.message_delay_s("coordinator", lambda: 0, 0.0)

    (still, after), _ = run_virtual(main())
    assert still == 0.05 and after == 0.0


def test_quorum_assignments_name_heal_sources_and_quorum_members():
    net = NetworkFaults(FakeHost("w2"), "127.0.0.1:1", random.Random(0))
    assert net.transport.peer_name("127.0.0.1:1") == "coordinator"
    net.transport.on_message("coordinator", QuorumAssigned(step=5, quorum_id=3, members=["w0", "w2"], rank=1,
                                                          heal_from="w0", heal_address="127.0.0.1:4242"))
    assert net.transport.peer_name("127.0.0.1:4242") == "w0"
    assert net.members_of(3) == ("w0", "w2") and net.members_of(2) is None
    # grants inside a Bundle count; one that says "the same members" ([]) keeps what is known
    net.transport.on_message("coordinator", Bundle(items=[
        StepDecision(step=5, quorum_id=3, commit=True, reason=""),
        QuorumAssigned(step=6, quorum_id=3, members=[], rank=1),
        QuorumAssigned(step=6, quorum_id=4, members=["w1", "w2"], rank=1)]))
    assert net.members_of(3) == ("w0", "w2") and net.members_of(4) == ("w1", "w2")


# ---- which workers get the seams at all ----
def test_the_launcher_leaves_the_seams_off_only_when_nothing_can_send_a_network_fault():
    from phalanx.faults.plan import parse_fault_plan
    from phalanx.runtime.launcher_faults import network_seams_env

    kill = parse_fault_plan('[[fault]]\nkind = "kill"\nworker = 1\nat_step = 3\n', "<t>")
    latency = parse_fault_plan('[[fault]]\nkind = "latency"\nmean_ms = 5\nat_step = 3\n', "<t>")
    partition = parse_fault_plan('[[fault]]\nkind = "partition"\ngroups = [[0], [1]]\nat_step = 3\nfor_s = 1.0\n',
                                 "<t>")
    assert network_seams_env(kill, "") == {"PHALANX_NETWORK_FAULTS": "0"}
    assert network_seams_env(latency, "") == {"PHALANX_NETWORK_FAULTS": "1"}
    assert network_seams_env(partition, "") == {"PHALANX_NETWORK_FAULTS": "1"}
    # a remote coordinator may carry another launcher's faults: keep them
    assert network_seams_env(kill, "10.0.0.1:7000") == {"PHALANX_NETWORK_FAULTS": "1"}


def test_the_worker_setting_defaults_on_and_a_bad_value_is_named():
    import pytest

    from phalanx.core.errors import ConfigError
    from phalanx.train.network_faults import NoNetworkFaults, network_faults_setting

    assert network_faults_setting({}) is True  # started by hand or by another tool: any fault may come
    assert network_faults_setting({"PHALANX_NETWORK_FAULTS": "0"}) is False
    with pytest.raises(ConfigError, match="PHALANX_NETWORK_FAULTS must be 0 or 1, got 'yes'"):
        network_faults_setting({"PHALANX_NETWORK_FAULTS": "yes"})
    factory = object()
    assert NoNetworkFaults().wrap(factory) is factory  # process groups left unwrapped


def test_without_seams_a_network_fault_is_logged_not_applied_and_others_still_route():
    from phalanx.train.network_faults import NoNetworkFaults

    net, logged, other = NoNetworkFaults(), [], []
    net.log = lambda event, **fields: logged.append((event, fields))
    route = net.route(other.append)
    route(InjectFault(kind="latency", mean_ms=5.0))
    route(InjectFault(kind="freeze", for_s=1.0))
    assert [e for e, _ in logged] == ["network_fault_ignored"] and "PHALANX_NETWORK_FAULTS=0" in logged[0][1]["reason"]
    assert [f.kind for f in other] == ["freeze"]
