"""Typed errors. Expected operating errors derive from PhalanxError; broken invariants are asserts."""

from __future__ import annotations


class PhalanxError(Exception):
    """Root of every expected operating error phalanx raises."""


class ConfigError(PhalanxError):
    """A configuration value, CLI flag or file is invalid. The message says where and what to do."""


class FaultPlanError(ConfigError):
    """A fault plan is invalid. Carries the file and line of the problem."""

    def __init__(self, path: str, line: int | None, problem: str) -> None:
        self.path = path
        self.line = line
        self.problem = problem
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {problem}")


class TransportError(PhalanxError):
    """A connection could not be made, was lost, or received something it must refuse."""


class ConnectionClosed(TransportError):
    """The peer closed the connection or it was closed after a protocol violation."""


class FrameRejected(TransportError):
    """A received frame failed authentication, size, version or decoding checks."""


class AuthError(FrameRejected):
    """A frame's HMAC did not verify under the cluster token."""


class ProtocolVersionError(FrameRejected):
    """The peer speaks a protocol version this build does not."""


class PeerTimeout(PhalanxError):
    """A peer did not answer before a deadline."""


class QuorumBroken(PhalanxError):
    """The quorum of the current step changed; the step must be rolled back and retried."""


class StaleEpoch(PhalanxError):
    """A message, collective or state transfer carried an older quorum id (fencing)."""


class CollectiveError(PhalanxError):
    """A collective failed or passed its deadline; the process group is abandoned."""


class HealError(PhalanxError):
    """A live state transfer from a peer failed (peer lost, checksum mismatch, stale epoch)."""


class CheckpointError(PhalanxError):
    """A durable checkpoint is missing, corrupt or does not match what it claims to be."""


class CoordinatorLost(PhalanxError):
    """The worker cannot reach the coordinator; it must not commit until it can."""


class JobFailed(PhalanxError):
    """The job as a whole cannot continue (all workers lost, restarts exhausted, ...)."""


class JobOver(PhalanxError):
    """The coordinator ended this worker's part in the job (it finished while this worker was behind,
    or it shut down). Not a failure of the job; the worker's state is not the final state."""


class StateCorrupt(PhalanxError):
    """Serialized training state failed its checksum or does not decode."""
