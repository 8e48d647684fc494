"""The experiments, in the order ``phalanx lab`` lists and ``phalanx lab all`` runs them."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.core.errors import ConfigError
from phalanx.lab.context import LabContext
from phalanx.lab.outcome import Outcome


@dataclass(frozen=True)
class Experiment:
    name: str
    module: str  # phalanx.lab.<module>, with run(ctx) -> Outcome
    summary: str
    sim_by_default: bool = False  # runs in the simulator unless --real (scales a laptop cannot run)
    quick_sim: bool = False  # --quick runs it in the simulator unless --real (its real form takes minutes)
    attr: str = "run"
    where: str = ""  # what `phalanx lab` lists as its default ("" = real processes or the simulator)

    def runner(self) -> Callable[[LabContext], Outcome]:
        fn: Callable[[LabContext], Outcome] = getattr(importlib.import_module(f"phalanx.lab.{self.module}"), self.attr)
        return fn


EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment("latency", "latency", "scaling efficiency vs workers as link latency grows (0/1/5/20 ms)"),
    Experiment("partial-failure", "partial_failure",
               "crash vs freeze vs slow vs lossy link vs hung-but-heartbeating: detection, recovery, work lost",
               quick_sim=True),
    Experiment("fallacy-reliable-network", "fallacies", "a partition with deadlines off hangs the job (--real too)",
               attr="reliable_network", sim_by_default=True),
    Experiment("fallacy-zero-latency", "fallacies", "a heartbeat timeout sized for a local link, on 20 ms links",
               attr="zero_latency", sim_by_default=True),
    Experiment("fallacy-infinite-bandwidth", "fallacies", "ring vs tree all-reduce of 1.4 GB of gradients",
               attr="infinite_bandwidth", sim_by_default=True),
    Experiment("fallacy-secure-network", "fallacies_cluster",
               "a forged frame, with and without the cluster key",
               attr="secure_network", where="sandbox"),
    Experiment("fallacy-fixed-topology", "fallacies_cluster",
               "a worker leaves for good: elastic quorum vs a fixed world",
               attr="fixed_topology", quick_sim=True),
    Experiment("fencing", "fencing", "a coordinator restart under a stale epoch, with and without its fencing floor",
               sim_by_default=True),
    Experiment("fallacy-one-administrator", "fallacies_cluster",
               "someone else's folder as --out: ownership check on/off",
               attr="one_administrator", where="sandbox"),
    Experiment("fallacy-zero-transport-cost", "fallacies", "an all-reduce every step vs a merge every 10 steps",
               attr="zero_transport_cost", sim_by_default=True),
    Experiment("fallacy-homogeneous-network", "fallacies_cluster",
               "a 4x slower worker: equal shares vs speed-sized shares",
               attr="homogeneous_network", quick_sim=True),
    Experiment("cap", "cap", "strict vs available vs local-sgd through a partition and a straggler",
               quick_sim=True),
    Experiment("one-in-a-thousand", "one_in_a_thousand",
               "1,000 workers, one stops answering; p99 of the slowest of N", sim_by_default=True),
    Experiment("serving-tail", "serving_tail", "one slow replica, routing policies side by side"),
)


def find(name: str) -> Experiment:
    for e in EXPERIMENTS:
        if e.name == name:
            return e
    raise ConfigError(f"no lab experiment {name!r}; `phalanx lab` lists them: "
                      f"{', '.join(e.name for e in EXPERIMENTS)}")
