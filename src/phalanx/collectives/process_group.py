"""ProcessGroup seam: the data plane, rebuilt for every quorum id.

``TorchProcessGroup`` wraps torch.distributed's groups: Gloo for CPU tensors, NCCL for CUDA ones
(:func:`backend_for`; a quorum's NCCL group is made on its first CUDA tensor). A collective is
awaited with a deadline; a group whose collective failed or passed it is *abandoned*: never waited
on again. An abandoned Gloo group is dropped at once, on a thread of its own (kept, one whose peer
was SIGKILLed spun a ``gloo_tcp_loop`` thread at a full core; its destructor waits out a frozen
peer's collective). NCCL groups, whose teardown with work in flight was not measured, stay in a
bounded graveyard until their own timeout has fired. The simulator supplies its own factory.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import threading
from typing import Any, Protocol

from phalanx.collectives.group_teardown import Graveyard, drop_on_thread, lower_priority, native_threads, threads_since
from phalanx.collectives.signed_store import signed_store
from phalanx.collectives.store_spares import StoreSpares
from phalanx.core.errors import CollectiveError, ConfigError

BACKEND_SETTINGS = ("auto", "gloo")  # PHALANX_BACKEND


def backend_for(setting: str, device_type: str) -> str:
    """The torch backend that all-reduces a tensor on ``device_type`` ("cpu", "cuda", ...) under
    ``setting``: ``auto`` (the default) is NCCL for CUDA tensors and Gloo for the rest; ``gloo`` is
    Gloo for every tensor (CUDA ones too: for workers sharing one GPU, which NCCL refuses)."""
    if setting not in BACKEND_SETTINGS:
        raise ConfigError(f"PHALANX_BACKEND={setting!r}: use one of {', '.join(BACKEND_SETTINGS)}")
    return "nccl" if setting == "auto" and device_type == "cuda" else "gloo"


def cuda_backend(gpus: list[str]) -> str:
    """NCCL when every rank of a group has a GPU of its own (``gpus``: each rank's host and GPU
    UUID, as every rank reads them from the store, so all ranks decide alike), else Gloo: NCCL
    refuses two ranks on one GPU ("invalid usage"), and a group that tried would fail every step."""
    return "nccl" if len(set(gpus)) == len(gpus) else "gloo"


class Pending(Protocol):
    """A collective already started: ``wait`` until it is done (raises CollectiveError on failure
    or at the deadline; cancelling the wait abandons the group)."""

    async def wait(self, timeout_s: float) -> None: ...

    def wait_here(self, slice_s: float) -> bool:
        """Block the calling thread (a body's thread, never an event loop) for at most ``slice_s``,
        or until ``wake``. True once nothing is left to wait for on this thread: the collective
        has finished (well or not: ``wait`` says which), or it finishes only on the loop
        (simulated, delayed by a network fault, on a GPU stream). Raises nothing."""

    def wake(self) -> None:
        """From any thread: end a ``wait_here`` now (the step is lost), or the next one at once."""


class ProcessGroup(Protocol):
    quorum_id: int
    rank: int
    world_size: int

    async def allreduce_sum(self, tensor: Any, timeout_s: float) -> None:
        """Sum ``tensor`` in place across the group; raises CollectiveError on failure or deadline."""

    def start_allreduce_sum(self, tensor: Any, share: float = 1.0) -> Pending | None:
        """Start summing ``tensor`` in place now, without waiting: from any thread for real groups
        (the autograd hooks of a backward pass call it), from the event loop for simulated ones.
        Every rank must start its collectives in the same order. None: not now (e.g. a network
        fault is active on the data plane): the caller issues it with ``allreduce_sum`` instead.
        ``share`` is the fraction of the step's gradient the tensor carries (0 for bookkeeping);
        simulated groups charge their modelled cost by it, real ones ignore it."""

    def abandon(self) -> None: ...


class _Done:
    async def wait(self, timeout_s: float) -> None:
        return None

    def wait_here(self, slice_s: float) -> bool:
        return True

    def wake(self) -> None:
        return None


class ProcessGroupFactory(Protocol):
    async def create(self, quorum_id: int, rank: int, world_size: int, timeout_s: float) -> ProcessGroup: ...


class LocalProcessGroup:
    """World size 1: nothing to exchange."""

    def __init__(self, quorum_id: int) -> None:
        self.quorum_id, self.rank, self.world_size = quorum_id, 0, 1

    async def allreduce_sum(self, tensor: Any, timeout_s: float) -> None:
        return None

    def start_allreduce_sum(self, tensor: Any, share: float = 1.0) -> Pending:
        return _Done()

    def abandon(self) -> None:
        return None


class TorchProcessGroup:
    def __init__(self, pg: Any, quorum_id: int, rank: int, world_size: int, graveyard: Graveyard,
                 make_cuda: Any = None, threads: set[int] | None = None) -> None:
        self._pg = pg  # Gloo, made when the quorum formed
        self._threads = threads or set()  # the native threads its constructor started (group_teardown.py)
        self.quorum_id, self.rank, self.world_size = quorum_id, rank, world_size
        self._graveyard = graveyard
        self._abandoned = False
        # (device) -> (group, backend name) for this quorum's CUDA tensors; None: Gloo carries them
        # (PHALANX_BACKEND=gloo, or no CUDA here)
        self._make_cuda = make_cuda
        self._cuda: Any = None
        self._lock = threading.Lock()  # the NCCL group is made once, from whichever thread asks first
        self.store: Any = None  # the rendezvous store the group was built on (kept as long as it)

    async def allreduce_sum(self, tensor: Any, timeout_s: float) -> None:
        await self.start_allreduce_sum(tensor).wait(timeout_s)

    def start_allreduce_sum(self, tensor: Any, share: float = 1.0) -> "_TorchPending":
        """Thread-safe: Gloo and NCCL queue the work on their own threads and streams."""
        pg = self._pg
        if self._abandoned or pg is None:
            raise CollectiveError(f"process group of quorum {self.quorum_id} was abandoned")
        try:
            if self._make_cuda is not None and tensor.is_cuda:
                pg = self._cuda_group(tensor.device)[0]
            return _TorchPending(self, pg.allreduce([tensor]), on_cpu=not tensor.is_cuda)
        except RuntimeError as e:
            self.abandon()
            raise CollectiveError(f"all-reduce could not start in quorum {self.quorum_id}: {_short(e)}") from e

    @property
    def backends(self) -> list[str]:
        """The backends this group has built: Gloo always, and what carries its CUDA tensors."""
        return sorted({"gloo", self._cuda[1]} if self._cuda is not None else {"gloo"})

    def _cuda_group(self, device: Any) -> tuple[Any, str]:
        with self._lock:
            if self._cuda is None:
                # every rank gets here at the same collective (ranks start collectives in the same
                # order), so the store rendezvous below and NCCL's own find all of them
                self._cuda = self._make_cuda(device)
            return self._cuda  # type: ignore[no-any-return]

    def abandon(self) -> None:
        if not self._abandoned:
            self._abandoned = True
            pg, self._pg = self._pg, None
            lower_priority(self._threads)  # a spinning I/O loop must not take the training thread's core
            drop_on_thread(pg, f"phalanx-pg-drop-q{self.quorum_id}")
            del pg
            with self._lock:
                if self._cuda is not None and self._cuda[1] == "nccl":
                    self._graveyard.bury((self._cuda[0], self.store))  # NCCL may still read its store
                self._cuda = None


class _TorchPending:
    def __init__(self, group: TorchProcessGroup, work: Any, on_cpu: bool = True) -> None:
        self._group, self._work, self._on_cpu = group, work, on_cpu
        self._bell: threading.Lock | None = None  # held until the work's future completes (or a wake)
        self._done = self._woken = False

    def wait_here(self, slice_s: float) -> bool:
        """Gloo on CPU tensors: wait (the GIL released) for one slice on a lock that the work's
        done-callback releases, on Gloo's thread, once per collective. Not ``Work.wait(timeout)``:
        each slice that ran out raised through C++, 0.1-0.15 ms of this thread's CPU (a 0.47 MB
        all-reduce takes a few slices). Never CUDA work: its ``wait`` only orders streams."""
        if self._done or not self._on_cpu or self._work.is_completed():
            return True
        bell = self._bell
        if bell is None:
            self._bell = bell = threading.Lock()
            bell.acquire()

            def on_done(_fut: Any) -> None:  # on Gloo's thread, or here if already complete
                self._done = True
                _ring(bell)
            self._work.get_future().add_done_callback(on_done)
            if self._woken:  # woken before the bell existed
                _ring(bell)
        bell.acquire(timeout=slice_s)
        return self._done

    def wake(self) -> None:
        self._woken = True
        if self._bell is not None:
            _ring(self._bell)

    async def wait(self, timeout_s: float) -> None:
        group = self._group
        work_fut = self._work.get_future()
        if work_fut.done():  # finished during backward (overlap): no thread hop, no timer
            try:
                work_fut.value()
                return
            except Exception as e:
                group.abandon()
                raise CollectiveError(f"all-reduce failed in quorum {group.quorum_id}: {_short(e)}") from e
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def on_done(fut: Any) -> None:  # on a Gloo/NCCL thread, or here if already complete
            def settle() -> None:
                if done.done():
                    return
                try:
                    fut.value()
                    done.set_result(None)
                except Exception as e:  # translated at this one boundary
                    done.set_exception(CollectiveError(f"all-reduce failed in quorum {group.quorum_id}: {_short(e)}"))
            loop.call_soon_threadsafe(settle)

        work_fut.add_done_callback(on_done)
        try:
            async with asyncio.timeout(timeout_s):  # one timer; a timeout cancels only our own future
                await done
        except asyncio.TimeoutError as e:
            group.abandon()
            raise CollectiveError(f"all-reduce in quorum {group.quorum_id} passed its {timeout_s:.1f} s deadline") from e
        except CollectiveError:
            group.abandon()
            raise
        except asyncio.CancelledError:
            group.abandon()  # the step was aborted (quorum broken): never touch this group again
            raise


def _ring(bell: threading.Lock) -> None:
    try:
        bell.release()
    except RuntimeError:  # rung already (a wake and the work's completion)
        pass


class TorchProcessGroupFactory:
    """Builds each quorum's groups from the coordinator's TCPStore, through :func:`signed_store`:
    a Gloo group when the quorum forms, and an NCCL one on its first CUDA tensor (``setting``:
    see :func:`backend_for`)."""

    def __init__(self, store_address: str, token: bytes, backend: str = "auto", connect_timeout_s: float = 10.0,
                 run_id: str = "") -> None:
        import torch
        import torch.distributed as dist

        # a bad setting is a ConfigError here, before any connection
        self._nccl_ok = backend_for(backend, "cuda") == "nccl" and torch.cuda.is_available()
        self._dist = dist
        host, _, port = store_address.rpartition(":")
        self._connect = lambda: dist.TCPStore(host, int(port), is_master=False,
                                              timeout=datetime.timedelta(seconds=connect_timeout_s))
        self._token, self._run_id = token, run_id
        # connections made ahead of need (store_spares.py); the first checks the store at join, so
        # an unreachable one fails here, not at the first quorum, and is the first group's
        self._spares = StoreSpares(self._connect)
        self._spares.offer(self._connect())
        # Keys are namespaced by a secret derived from the cluster token, so a party without the
        # token cannot guess them to hijack rendezvous (the TCPStore itself is unauthenticated).
        self._namespace = hmac.new(token, b"phalanx-store", hashlib.sha256).hexdigest()[:16]
        self._graveyard = Graveyard(hold_s=2 * 60.0)

    def _store_for_group(self) -> Any:
        """A store connection of the group's own, its values signed and bound to this job and
        (through the key) the quorum. Own: a TCPStore client runs one request at a time, and a
        build that waits on a member that hangs mid-rendezvous (a GIL hang, SIGSTOP) blocks its
        connection until its deadline; on a shared one the next quorum's build waited behind it
        (4.45 s in a demo run whose GIL hang landed during a group build). The group keeps it
        referenced: torch holds only the C++ half, and a collected Python store loses its methods.
        Made ahead of need where it can be (``StoreSpares``): a connect can wait seconds on DNS."""
        return signed_store(self._spares.take(), self._token, self._run_id)

    async def create(self, quorum_id: int, rank: int, world_size: int, timeout_s: float) -> ProcessGroup:
        if world_size == 1:
            return LocalProcessGroup(quorum_id)
        loop = asyncio.get_running_loop()
        timeout = datetime.timedelta(seconds=timeout_s)
        result: asyncio.Future[Any] = loop.create_future()
        stores: list[Any] = []

        def build() -> None:  # the constructor blocks until every rank has connected
            try:
                stores.append(self._store_for_group())  # connects: off the event loop
                prefix = self._dist.PrefixStore(f"{self._namespace}/q{quorum_id}", stores[0])
                before = native_threads()
                pg = self._dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
            except Exception as e:
                self._spares.discard()  # the store may have gone: the next build connects afresh
                loop.call_soon_threadsafe(_settle, result, None, e)
                return
            loop.call_soon_threadsafe(_settle, result, (pg, threads_since(before)), None)

        threading.Thread(target=build, name=f"phalanx-pg-q{quorum_id}", daemon=True).start()
        try:
            pg, threads = await asyncio.wait_for(asyncio.shield(result), timeout_s)
        except asyncio.TimeoutError as e:
            raise CollectiveError(f"process group for quorum {quorum_id} did not form within {timeout_s:.1f} s") from e
        except RuntimeError as e:
            raise CollectiveError(f"process group for quorum {quorum_id} failed to form: {_short(e)}") from e
        self._graveyard.sweep()

        def make_cuda(device: Any) -> tuple[Any, str]:
            # on the first CUDA tensor: all ranks publish which GPU they hold, then all decide alike
            prefix = self._dist.PrefixStore(f"{self._namespace}/q{quorum_id}/cuda", stores[0])
            prefix.set(f"gpu/{rank}", _gpu_identity(device).encode())
            gpus = [bytes(prefix.get(f"gpu/{r}")).decode() for r in range(world_size)]
            if cuda_backend(gpus) == "gloo":
                return pg, "gloo"
            nccl_prefix = self._dist.PrefixStore(f"{self._namespace}/q{quorum_id}/nccl", stores[0])
            return self._dist.ProcessGroupNCCL(nccl_prefix, rank, world_size, self._nccl_options(timeout)), "nccl"

        group = TorchProcessGroup(pg, quorum_id, rank, world_size, self._graveyard,
                                  make_cuda if self._nccl_ok else None, threads)
        group.store = stores[0]  # referenced as long as the group (see _store_for_group)
        return group

    def _nccl_options(self, timeout: datetime.timedelta) -> Any:
        opts = self._dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return opts


def _gpu_identity(device: Any) -> str:
    """This host and the GPU behind ``device`` (its UUID: the same GPU under any CUDA_VISIBLE_DEVICES)."""
    import socket

    import torch

    props = torch.cuda.get_device_properties(device)
    return f"{socket.gethostname()}/{getattr(props, 'uuid', device)}"


def _settle(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if fut.done():
        if value is not None:
            # An abandoned build finished late: nobody will use it. Destroying a process group can
            # block (Gloo closes its connections), so the last reference is dropped on a thread of
            # its own, not on the event loop that heartbeats.
            pg, threads = value
            del value
            lower_priority(threads)
            drop_on_thread(pg, "phalanx-drop-pg")
            del pg
        return
    if error is not None:
        fut.set_exception(RuntimeError(str(error)))
    else:
        fut.set_result(value)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:240]


class RendezvousStore:
    """The torch TCPStore the workers' process groups rendezvous through, listening on ``host``
    only. torch's own TCPStore server listens on every interface whatever host it is given; this
    one binds the listening socket itself and hands torch its descriptor, so a local run's store
    is reachable from loopback alone (and a multi-machine coordinator's from the address it was
    told to bind)."""

    def __init__(self, host: str) -> None:
        import socket

        import torch.distributed as dist

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            sock.listen(512)
            self.host, self.port = host, sock.getsockname()[1]
        except OSError:
            sock.close()
            raise
        # torch owns the descriptor from here on (it closes it when the store goes): detach it, so
        # Python never closes that number again (it may belong to someone else by then)
        self.store: Any = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                        master_listen_fd=sock.detach())

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop listening: torch's store server, and the descriptor it owns, end with the store."""
        self.store = None
