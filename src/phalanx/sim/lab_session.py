"""The lab session gate: mechanism switches that exist only for ``phalanx lab``.

A lab session is open only inside :func:`lab_session` (opened by the lab runner and the lab's
tests): it sets ``PHALANX_LAB_SESSION`` to a nonce only this process knows, so setting the
variable by hand does not open one. It lives here, below the lab, so that the simulator can refuse
its own lab-only fields (``Cluster.restart_fencing_floor = False``) without importing the lab;
``phalanx.lab.switches`` re-exports it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

from phalanx.core.errors import ConfigError

LAB_ENV = "PHALANX_LAB_SESSION"  # set by lab_session() to a nonce only this process knows
_nonce: str | None = None


def in_lab_session() -> bool:
    return _nonce is not None and os.environ.get(LAB_ENV) == _nonce


def require_lab_session(what: str) -> None:
    """Raise ConfigError unless a lab session is open: ``what`` is a lab-only mechanism switch."""
    if not in_lab_session():
        raise ConfigError(f"{what} can only be set inside `phalanx lab` (it switches a mechanism off to "
                          "demonstrate a failure); remove it from this configuration")


@contextlib.contextmanager
def lab_session() -> Iterator[None]:
    """The only place where mechanisms may be switched off. Nested sessions reuse the outer one."""
    global _nonce
    if in_lab_session():
        yield
        return
    old = os.environ.get(LAB_ENV)
    _nonce = secrets.token_hex(8)
    os.environ[LAB_ENV] = _nonce
    try:
        yield
    finally:
        _nonce = None
        if old is None:
            os.environ.pop(LAB_ENV, None)
        else:
            os.environ[LAB_ENV] = old
