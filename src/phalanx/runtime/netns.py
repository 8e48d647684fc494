"""``--network namespaces``: each worker in a network namespace of its own, network faults in the kernel.

One run's topology (every name carries a per-run prefix such as ``phx3fa2c``, so parallel runs and
leftovers are told apart; the subnet's third octet X is one no other interface uses)::

    root namespace: coordinator + TCPStore listen on 10.213.X.1 (the bridge)
      <p>b0 (bridge, 10.213.X.1/24)
        |-- <p>h0 ==veth== <p>n0  netns <p>-w0  10.213.X.2
        |-- <p>h1 ==veth== <p>n1  netns <p>-w1  10.213.X.3
        `-- ...
      <p>b1, <p>b2 ... (bridges without an address): created only while a partition is on

Worker processes start as ``ip netns exec <p>-wI COMMAND`` (which execs, so the pid the supervisor
signals is the worker's own), bind their heal listener to their address (``PHALANX_HEAL_BIND``) and
Gloo to their veth (``GLOO_SOCKET_IFNAME``); everything they send crosses a real veth and bridge.

What the kernel does (``KernelFaults``):
- partition: the host-side ends of side k > 0 move onto bridge <p>bk. Each side still switches
  internally, nothing crosses between sides, and open TCP connections are not reset: their packets
  are lost until the ends move back, as in a real partition. The coordinator stays on side 0 (the
  simulator's convention). ``one_way`` cannot be built from bridges and stays at the seam.
- bandwidth: a tbf qdisc on the worker's namespace-side veth, i.e. its egress (the simulator models
  per-node egress bandwidth too). ``pair`` stays at the seam.
- latency, loss: netem on the host-side end (traffic towards the worker) when this kernel has netem;
  probed once per process. Without it, or with ``pair``, they stay at the seam.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.core.errors import ConfigError, FaultPlanError
from phalanx.faults.plan import Fault, FaultKind

SUBNET_BASE = "10.213"  # a private range; the third octet is chosen per run
MAX_WORKERS = 250  # addresses .2 .. .251 of the run's /24
IP_TIMEOUT_S = 10.0
_netem: bool | None = None  # probed once per process
log = logging.getLogger("phalanx")
# One JSON file per live run: its launcher's pid and every name it created. A run whose launcher
# died without tearing down (SIGKILL) is cleaned up by the next run that starts.
STATE_DIR = Path("/run/phalanx-netns")


class NetworkSetupError(ConfigError):
    """The namespaces network could not be built (not root, iproute2 missing, namespaces refused)."""


@dataclass(frozen=True)
class WorkerLink:
    index: int
    netns: str
    host_end: str  # veth end on the bridge, in the root namespace
    ns_end: str  # veth end inside the worker's namespace
    address: str


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetworkSetupError(f"`{' '.join(argv)}` could not run: {e}") from e
    if check and done.returncode != 0:
        raise NetworkSetupError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done


def check_available() -> None:
    """Raise NetworkSetupError saying what to do when this machine cannot build the network."""
    if not sys.platform.startswith("linux"):
        raise NetworkSetupError("--network namespaces needs Linux network namespaces; use --network loopback")
    if os.geteuid() != 0:
        raise NetworkSetupError("--network namespaces creates network namespaces, veth pairs and a bridge, which "
                                "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN): run as root, or use --network loopback")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetworkSetupError(f"--network namespaces needs `{tool}` from iproute2 on PATH: install iproute2 "
                                    "(e.g. apt-get install iproute2), or use --network loopback")


def has_netem(probe_device: str) -> bool:
    """Whether this kernel has the netem qdisc (often a module a container cannot load). Probed once."""
    global _netem
    if _netem is None:
        _netem = _run(["tc", "qdisc", "add", "dev", probe_device, "root", "netem", "delay", "10ms"],
                      check=False).returncode == 0
        if _netem:
            _run(["tc", "qdisc", "del", "dev", probe_device, "root"], check=False)
    return _netem


def cleanup_leftovers() -> list[str]:
    """Remove the namespaces, veths and bridges of runs whose launcher is dead (killed before its
    teardown). Only names a state file records, only for a dead pid: never another live run's,
    never anything phalanx did not create. Returns the prefixes cleaned."""
    cleaned = []
    for state in sorted(STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []:
        try:
            doc = json.loads(state.read_text())
            pid, prefix = int(doc["pid"]), str(doc["prefix"])
            links = [(str(h), str(n)) for h, n in doc.get("links", [])]
            bridge = str(doc["bridge"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours to interpret: leave it
        if _pid_alive(pid) or not all(x.startswith(prefix) for x in [bridge, *[n for pair in links for n in pair]]):
            continue
        for host_end, ns in links:
            _run(["ip", "link", "del", host_end], check=False)
            _run(["ip", "netns", "del", ns], check=False)
        for k in range(0, 8):
            _run(["ip", "link", "del", f"{prefix}b{k}"], check=False)
        state.unlink(missing_ok=True)
        log.warning("removed the network of a dead run (launcher pid %d): %s", pid, prefix)
        cleaned.append(prefix)
    return cleaned


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _used_third_octets() -> set[int]:
    out = _run(["ip", "-o", "-4", "addr", "show"]).stdout + _run(["ip", "-4", "route", "show"]).stdout
    used = set()
    for word in out.split():
        if word.startswith(SUBNET_BASE + "."):
            parts = word.split("/")[0].split(".")
            if len(parts) == 4 and parts[2].isdigit():
                used.add(int(parts[2]))
    return used


class NamespaceNetwork:
    """The bridge, veth pairs and namespaces of one run; ``teardown`` removes all of them."""

    def __init__(self, workers: int, prefix: str = "") -> None:
        if not 1 <= workers <= MAX_WORKERS:
            raise NetworkSetupError(f"--network namespaces supports 1..{MAX_WORKERS} workers, got {workers}")
        self.workers = workers
        self.prefix = prefix or "phx" + os.urandom(3).hex()[:5]
        self.bridge = f"{self.prefix}b0"
        self.octet = 0
        self.links: list[WorkerLink] = []
        self.netem = False
        self._side_bridges: list[str] = []
        self._bridge_made = False
        self._torn_down = False
        self._old_sigterm: Any = None

    # ---- lifecycle ----
    def setup(self) -> None:
        check_available()
        cleanup_leftovers()
        self._trap_sigterm()
        try:
            self._setup_bridge()
            self._save_state()
            for i in range(self.workers):
                self._setup_worker(i)
                self._save_state()
            self.netem = has_netem(self.links[0].host_end)
        except BaseException:
            self.teardown()
            raise

    def _setup_bridge(self) -> None:
        for _ in range(5):  # two runs starting at once may pick the same subnet: check, retry
            free = sorted(set(range(1, 255)) - _used_third_octets())
            if not free:
                raise NetworkSetupError(f"no free /24 left in {SUBNET_BASE}.0.0/16 for --network namespaces")
            self.octet = free[int.from_bytes(os.urandom(2), "big") % len(free)]
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._bridge_made = True
            _run(["ip", "addr", "add", f"{self.coordinator_host}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            if _subnet_owners(self.octet) == [self.bridge]:
                return
            _run(["ip", "link", "del", self.bridge], check=False)
            self._bridge_made = False
        raise NetworkSetupError(f"could not claim a free subnet in {SUBNET_BASE}.0.0/16 after 5 tries")

    def _setup_worker(self, i: int) -> None:
        link = WorkerLink(i, f"{self.prefix}-w{i}", f"{self.prefix}h{i}", f"{self.prefix}n{i}",
                          f"{SUBNET_BASE}.{self.octet}.{i + 2}")
        done = _run(["ip", "netns", "add", link.netns], check=False)
        if done.returncode != 0:
            raise NetworkSetupError(f"`ip netns add {link.netns}` failed: {done.stderr.strip()}. Creating network "
                                    "namespaces needs CAP_SYS_ADMIN and a writable /run/netns (in a container: "
                                    "--privileged); otherwise use --network loopback")
        self.links.append(link)
        _run(["ip", "link", "add", link.host_end, "type", "veth", "peer", "name", link.ns_end, "netns", link.netns])
        _run(["ip", "link", "set", link.host_end, "master", self.bridge, "up"])
        _run(["ip", "-n", link.netns, "addr", "add", f"{link.address}/24", "dev", link.ns_end])
        _run(["ip", "-n", link.netns, "link", "set", link.ns_end, "up"])
        _run(["ip", "-n", link.netns, "link", "set", "lo", "up"])

    def teardown(self) -> None:
        """Remove everything this run created; safe to call twice and after a partial setup."""
        if self._torn_down:
            return
        self._torn_down = True
        commands = [["ip", "link", "del", b] for b in self._side_bridges]
        for link in self.links:  # deleting one end deletes the pair, even if a process still holds the netns
            commands += [["ip", "link", "del", link.host_end], ["ip", "netns", "del", link.netns]]
        if self._bridge_made:
            commands.append(["ip", "link", "del", self.bridge])
        for argv in commands:  # best effort: one failure must not keep the rest in place
            try:
                _run(argv, check=False)
            except NetworkSetupError as e:
                log.warning("teardown: %s", e)
        (STATE_DIR / f"{self.prefix}.json").unlink(missing_ok=True)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _save_state(self) -> None:
        """Record what this run created (before and while creating it), for ``cleanup_leftovers``."""
        try:
            STATE_DIR.mkdir(mode=0o700, exist_ok=True)
            tmp = STATE_DIR / f"{self.prefix}.tmp"
            tmp.write_text(json.dumps({"pid": os.getpid(), "prefix": self.prefix, "bridge": self.bridge,
                                       "links": [[lk.host_end, lk.netns] for lk in self.links]}))
            os.replace(tmp, STATE_DIR / f"{self.prefix}.json")
        except OSError as e:
            log.warning("cannot record the run's network in %s (%s): a SIGKILLed launcher's leftovers will "
                        "need `ip netns del` by hand", STATE_DIR, e.strerror)

    def _trap_sigterm(self) -> None:
        """SIGTERM would end the process without running ``finally``: turn it into KeyboardInterrupt
        (like Ctrl-C) for the run's duration, so the network is torn down either way."""
        import threading

        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def on_sigterm(signum: int, frame: Any) -> None:
                raise KeyboardInterrupt("SIGTERM")

            self._old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def leftovers(self) -> list[str]:
        """Namespaces and links of this run that still exist (empty after a clean teardown)."""
        names = _run(["ip", "netns", "list"]).stdout.split()
        names += [line.split(":")[1].strip().split("@")[0] for line in _run(["ip", "-o", "link"]).stdout.splitlines()
                  if line.count(":") >= 2]
        return sorted(n for n in names if n.startswith(self.prefix))

    def describe(self) -> dict[str, Any]:
        return {"network": "namespaces", "prefix": self.prefix, "bridge": self.bridge,
                "subnet": f"{SUBNET_BASE}.{self.octet}.0/24", "coordinator_host": self.coordinator_host,
                "netem": self.netem,
                "workers": [{"worker": f"w{x.index}", "netns": x.netns, "host_end": x.host_end,
                             "ns_end": x.ns_end, "address": x.address} for x in self.links]}

    def write_description(self, run_dir: Path) -> None:
        (run_dir / "network.json").write_text(json.dumps(self.describe(), indent=2))

    # ---- what workers and the coordinator need ----
    @property
    def coordinator_host(self) -> str:
        return f"{SUBNET_BASE}.{self.octet}.1"

    def worker_command(self, index: int, argv: list[str]) -> tuple[list[str], dict[str, str]]:
        link = self.links[index]
        env = {"PHALANX_HEAL_BIND": f"{link.address}:0", "GLOO_SOCKET_IFNAME": link.ns_end}
        return ["ip", "netns", "exec", link.netns, *argv], env

    # ---- faults ----
    def partition(self, sides: dict[int, int]) -> None:
        """Move the host ends of side k > 0 onto bridge k; workers not named stay on side 0."""
        self.heal_partition()
        for k in sorted(set(sides.values()) - {0}):
            b = f"{self.prefix}b{k}"
            _run(["ip", "link", "add", b, "type", "bridge"])
            self._side_bridges.append(b)
            _run(["ip", "link", "set", b, "up"])
        for i in sorted(sides):
            if sides[i] != 0:
                _run(["ip", "link", "set", self.links[i].host_end, "master", f"{self.prefix}b{sides[i]}"])

    def heal_partition(self) -> None:
        for link in self.links:
            _run(["ip", "link", "set", link.host_end, "master", self.bridge])
        for b in self._side_bridges:
            _run(["ip", "link", "del", b], check=False)
        self._side_bridges = []

    def set_bandwidth(self, index: int, bytes_per_s: float) -> None:
        link = self.links[index]
        rate_bits = max(8, int(bytes_per_s * 8))
        burst = max(3000, int(bytes_per_s / 50))  # ~20 ms of traffic, at least two full frames
        _run(["ip", "netns", "exec", link.netns, "tc", "qdisc", "replace", "dev", link.ns_end, "root", "tbf",
              "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "200ms"])

    def clear_bandwidth(self, index: int) -> None:
        link = self.links[index]
        _run(["ip", "netns", "exec", link.netns, "tc", "qdisc", "del", "dev", link.ns_end, "root"], check=False)

    def set_netem(self, index: int, args: list[str]) -> None:
        _run(["tc", "qdisc", "replace", "dev", self.links[index].host_end, "root", "netem", *args])

    def clear_netem(self, index: int) -> None:
        _run(["tc", "qdisc", "del", "dev", self.links[index].host_end, "root"], check=False)


def _subnet_owners(octet: int) -> list[str]:
    net = ipaddress.ip_network(f"{SUBNET_BASE}.{octet}.0/24")
    owners = []
    for line in _run(["ip", "-o", "-4", "addr", "show"]).stdout.splitlines():
        words = line.split()
        if "inet" in words:
            addr = words[words.index("inet") + 1].split("/")[0]
            if ipaddress.ip_address(addr) in net:
                owners.append(words[1])
    return sorted(owners)


class KernelFaults:
    """The network faults a NamespaceNetwork acts out in the kernel, and the runner that times them."""

    def __init__(self, net: NamespaceNetwork) -> None:
        self.net = net

    def takes(self, f: Fault) -> bool:
        if f.kind is FaultKind.PARTITION:
            return not f.param("one_way", False)
        if f.kind is FaultKind.BANDWIDTH:
            return f.param("pair") is None
        if f.kind in (FaultKind.LATENCY, FaultKind.LOSS):
            return self.net.netem and f.param("pair") is None
        return False

    def check(self, f: Fault, path: str) -> None:
        """Refuse a worker index outside the run before it starts, with the plan's file and line."""
        named = [f.param("isolate")] if f.param("isolate") is not None else []
        named += [i for group in f.param("groups") or [] for i in group] + list(f.param("workers") or [])
        for i in named:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.net.workers:
                raise FaultPlanError(path, f.line, f"fault #{f.index + 1} ({f.kind.value}): worker {i!r} does not "
                                     f"exist in a run of {self.net.workers} workers (0..{self.net.workers - 1})")

    def targets(self, f: Fault) -> list[int]:
        """Worker indices a fault acts on (for a partition: those cut off from the coordinator)."""
        if f.kind is FaultKind.PARTITION:
            return sorted(i for i, side in partition_sides(f, self.net.workers).items() if side != 0)
        listed = f.param("workers")
        return sorted(int(i) for i in listed) if listed else list(range(self.net.workers))

    def apply(self, f: Fault) -> None:
        if f.kind is FaultKind.PARTITION:
            self.net.partition(partition_sides(f, self.net.workers))
        elif f.kind is FaultKind.BANDWIDTH:
            for i in self.targets(f):
                self.net.set_bandwidth(i, float(f.param("bytes_per_s")))
        elif f.kind in (FaultKind.LATENCY, FaultKind.LOSS):
            for i in self.targets(f):
                self.net.set_netem(i, netem_args(f))
        else:
            raise AssertionError(f"fault kind {f.kind.value} is not a kernel fault")

    def lift(self, f: Fault) -> None:
        if f.kind is FaultKind.PARTITION:
            self.net.heal_partition()
        elif f.kind is FaultKind.BANDWIDTH:
            for i in self.targets(f):
                self.net.clear_bandwidth(i)
        else:
            for i in self.targets(f):
                self.net.clear_netem(i)

    async def run(self, faults: tuple[Fault, ...], wait_for_trigger: Callable[[Fault], Awaitable[None]],
                  record: Callable[[Fault, list[int]], Any], ended: Callable[[Any], None]) -> None:
        """Carry out ``faults`` (each ``takes``-checked): wait for its trigger, record it, apply it,
        and lift it after ``for_s`` (a fault without ``for_s`` lasts until the run ends)."""
        async def one(f: Fault) -> None:
            await wait_for_trigger(f)
            rec = record(f, self.targets(f))
            self.apply(f)
            if f.for_s:
                await asyncio.sleep(f.for_s)
                self.lift(f)
                ended(rec)

        await asyncio.gather(*(one(f) for f in faults))


def partition_sides(f: Fault, workers: int) -> dict[int, int]:
    """Worker index -> side, as the simulator does it: isolate = W, groups, or else the upper
    minority (workers half+1 .. N-1) cut off. The coordinator stays with side 0."""
    isolate, groups = f.param("isolate"), f.param("groups")
    if isolate is not None:
        return {int(isolate): 1}
    if groups:
        return {int(i): side for side, group in enumerate(groups) for i in group}
    return {i: 1 for i in range(workers // 2 + 1, workers)}


def netem_args(f: Fault) -> list[str]:
    if f.kind is FaultKind.LOSS:
        return ["loss", f"{100.0 * float(f.param('probability')):g}%"]
    args = ["delay", f"{float(f.param('mean_ms')):g}ms"]
    jitter_ms = float(f.param("jitter_ms", 0.0))
    dist = str(f.param("distribution", "normal"))
    if jitter_ms > 0 and dist != "constant":
        args += [f"{jitter_ms:g}ms", "distribution", "pareto" if dist == "pareto" else "normal"]
    return args


def wait_for_teardown(net: NamespaceNetwork, timeout_s: float = 2.0) -> list[str]:
    """Leftover names after teardown (the kernel frees a namespace's links asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = net.leftovers()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)
