"""The rendezvous store a quorum's process group is built on, with every value signed: a party that
reaches the TCPStore without the cluster token cannot inject a peer into a group."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any


def signed_store(inner: Any, token: bytes, run_id: str) -> Any:
    """``inner`` (a torch store) with every value signed with a key derived from the cluster token
    and the run id, over the value's full key (``namespace/q<quorum id>/...``): a value not written
    by a member of this job, or written for another quorum or job, is refused when read, so a
    party that can reach the TCPStore but lacks the token cannot inject a peer into a process
    group. (It can still delete or overwrite keys: rendezvous then fails at its deadline; it never
    joins a stranger.) A ``torch.distributed.Store`` subclass, so Gloo and NCCL call it from their
    own threads; keep a reference to it while torch uses it (torch holds only the C++ half)."""
    import torch.distributed as dist

    key = hmac.new(token, b"phalanx-store-values:" + run_id.encode(), hashlib.sha256).digest()

    class _Signed(dist.Store):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        @staticmethod
        def _mac(k: str, v: bytes) -> bytes:
            return hmac.new(key, k.encode() + b"\0" + v, hashlib.sha256).digest()

        def set(self, k: str, v: Any) -> None:
            v = bytes(v)
            self.inner.set(k, self._mac(k, v) + v)

        def get(self, k: str) -> bytes:
            raw = bytes(self.inner.get(k))
            mac, v = raw[:32], raw[32:]
            if len(raw) < 32 or not hmac.compare_digest(mac, self._mac(k, v)):
                raise RuntimeError(f"rendezvous value {k!r} is not signed with this job's cluster key: refused")
            return v

        def add(self, k: str, n: int) -> int:
            return int(self.inner.add(k, n))

        def check(self, keys: list[str]) -> bool:
            return bool(self.inner.check(keys))

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

        def set_timeout(self, timeout: Any) -> None:
            self.inner.set_timeout(timeout)

        def delete_key(self, k: str) -> bool:
            return bool(self.inner.delete_key(k))

        def num_keys(self) -> int:
            return int(self.inner.num_keys())

        def compare_set(self, k: str, expected: Any, desired: Any) -> bytes:
            return bytes(self.inner.compare_set(k, expected, desired))

    return _Signed()
