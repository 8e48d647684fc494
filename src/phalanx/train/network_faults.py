"""Network faults on a real worker: the controller behind its FaultyTransport and process groups.

The launcher's fault injector sends network faults (partition, latency, loss, bandwidth) to the
affected workers as ``InjectFault`` messages through the coordinator. This controller, on the
worker's control thread, applies each one to the node's ``NetworkConditions``, which both seams
read: the ``FaultyTransport`` (control plane: coordinator link, heal links) and every
``FaultyProcessGroup`` (data plane), and lifts it after ``for_s`` on the worker's own clock.

It also watches delivered ``QuorumAssigned`` messages for two facts the seams cannot see: who
listens at a heal address (to name heal connections) and who the members of a quorum id are
(to tell whether a collective crosses the partition).
"""

from __future__ import annotations

import asyncio
import atexit
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from phalanx.collectives.faulty import FaultyProcessGroupFactory
from phalanx.collectives.process_group import ProcessGroupFactory
from phalanx.core.errors import ConfigError
from phalanx.core.host import Host
from phalanx.core.messages import Bundle, InjectFault, QuorumAssigned
from phalanx.transport.faulty import COORDINATOR, DISTRIBUTIONS, FaultyTransport, LinkEffect, NetworkConditions

NETWORK_FAULT_KINDS = frozenset({"partition", "latency", "loss", "bandwidth"})
EXIT_FLUSH_S = 2.0  # at most this long at exit to let queued messages out
MEMBERS_KEPT = 16  # quorum ids whose member lists are remembered (older ones are never used again)


def link_effect(fault: InjectFault) -> LinkEffect:
    """The link degradation an InjectFault of kind latency, loss or bandwidth describes."""
    peers = frozenset(fault.peers) if fault.peers else None
    if fault.kind == "latency":
        dist = fault.distribution if fault.distribution in DISTRIBUTIONS else "normal"
        return LinkEffect(latency_s=fault.mean_ms / 1000, jitter_s=fault.jitter_ms / 1000, distribution=dist,
                          peers=peers)
    if fault.kind == "loss":
        return LinkEffect(loss_probability=fault.probability, peers=peers)
    assert fault.kind == "bandwidth" and fault.bytes_per_s > 0, fault
    return LinkEffect(bandwidth_bytes_per_s=fault.bytes_per_s, peers=peers)


def partition_sides(fault: InjectFault) -> dict[str, int]:
    return {name: side for side, group in enumerate(fault.groups) for name in group}


class NetworkFaults:
    def __init__(self, host: Host, coordinator_address: str, rng: random.Random,
                 log: Callable[..., None] | None = None) -> None:
        self._host = host
        self.log: Callable[..., None] = log or (lambda event, **fields: None)  # e.g. the worker's span log
        self.conditions = NetworkConditions(host.name, rng)
        self.transport = FaultyTransport(host.transport, self.conditions, host.now, host.sleep,
                                         names={coordinator_address: COORDINATOR}, on_message=self._observe)
        self._members: dict[int, tuple[str, ...]] = {}
        self._generation: dict[str, int] = {}  # per kind: a later fault of a kind replaces the earlier

    @classmethod
    def install(cls, host: Host, coordinator_address: str, rng: random.Random,
                log: Callable[..., None] | None = None) -> "NetworkFaults":
        """Put a FaultyTransport in front of ``host.transport`` (before anything connects)."""
        net = cls(host, coordinator_address, rng, log)
        host.transport = net.transport
        atexit.register(net.flush_at_exit)
        return net

    def flush_at_exit(self, timeout_s: float = EXIT_FLUSH_S) -> None:
        """Deliver what is still queued (a final Goodbye behind a delay), as the kernel would for
        a process that exits with data in its socket buffers. Runs on the exiting main thread."""
        loop = self.transport.loop
        if loop is None or not loop.is_running() or not self.transport.has_backlog:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.transport.drain(timeout_s), loop).result(timeout_s + 1.0)
        except Exception:  # exiting anyway: an undelivered message is what a cut link does too
            pass

    def wrap(self, factory: ProcessGroupFactory) -> FaultyProcessGroupFactory:
        return FaultyProcessGroupFactory(factory, self.conditions, self.members_of, self._host.now, self._host.sleep)

    def route(self, other: Callable[[InjectFault], None]) -> Callable[[InjectFault], None]:
        """An on_fault callback: network kinds come here, every other kind goes to ``other``."""
        def on_fault(fault: InjectFault) -> None:
            (self.on_fault if fault.kind in NETWORK_FAULT_KINDS else other)(fault)
        return on_fault

    def members_of(self, quorum_id: int) -> Sequence[str] | None:
        return self._members.get(quorum_id)

    # ---- faults (control thread) ----
    def on_fault(self, fault: InjectFault) -> None:
        gen = self._generation.get(fault.kind, 0) + 1
        self._generation[fault.kind] = gen
        if fault.kind == "partition":
            sides = partition_sides(fault)
            self.conditions.partition(sides, fault.one_way)
            self.log("network_fault_begin", kind=fault.kind, for_s=fault.for_s, one_way=fault.one_way,
                      side=self.conditions.side(self._host.name))
        else:
            effect = link_effect(fault)
            self.conditions.set_effect(fault.kind, effect)
            self.log("network_fault_begin", kind=fault.kind, for_s=fault.for_s,
                      peers=sorted(effect.peers) if effect.peers else "all")
        if fault.for_s > 0:
            self._host.spawn(self._lift_after(fault.kind, gen, fault.for_s), f"lift-{fault.kind}")

    async def _lift_after(self, kind: str, generation: int, for_s: float) -> None:
        await self._host.sleep(for_s)
        if self._generation.get(kind) != generation:
            return  # replaced by a later fault of the same kind, which lifts itself
        if kind == "partition":
            self.conditions.heal_partition()
        else:
            self.conditions.clear_effect(kind)
        self.log("network_fault_end", kind=kind)

    # ---- what the seams cannot see ----
    def _observe(self, peer: str, message: Any) -> None:
        if isinstance(message, Bundle):  # a decision and the next grant in one frame
            for m in message.items:
                self._observe(peer, m)
            return
        if not isinstance(message, QuorumAssigned):
            return
        if message.members:  # [] = the epoch's members, unchanged: already known from its first grant
            self._members[message.quorum_id] = tuple(message.members)
        for q in sorted(self._members)[:-MEMBERS_KEPT]:
            del self._members[q]
        if message.heal_from and message.heal_address:
            self.transport.learn_peer(message.heal_address, message.heal_from)


class NoNetworkFaults:
    """A worker that nothing can send a network fault to (the launcher said so): its transport and
    process groups are left unwrapped, so a control message skips the seams' queue, task and
    partition checks. A network fault that arrives anyway is logged and not applied."""

    def __init__(self) -> None:
        self.log: Callable[..., None] = lambda event, **fields: None

    def wrap(self, factory: ProcessGroupFactory) -> ProcessGroupFactory:
        return factory

    def route(self, other: Callable[[InjectFault], None]) -> Callable[[InjectFault], None]:
        def on_fault(fault: InjectFault) -> None:
            if fault.kind in NETWORK_FAULT_KINDS:
                self.log("network_fault_ignored", kind=fault.kind,
                         reason="this worker was started without network-fault seams (PHALANX_NETWORK_FAULTS=0)")
                return
            other(fault)
        return on_fault


def network_faults_setting(env: Mapping[str, str]) -> bool:
    """Does this worker need the seams? ``PHALANX_NETWORK_FAULTS`` "1" (the default: a worker
    started by hand or by another tool may be sent any fault) or "0" (the launcher's word that
    nothing will send it a network fault)."""
    setting = env.get("PHALANX_NETWORK_FAULTS", "1")
    if setting not in ("0", "1"):
        raise ConfigError(f"PHALANX_NETWORK_FAULTS must be 0 or 1, got {setting!r}")
    return setting == "1"

