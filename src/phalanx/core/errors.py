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


class FinalStateUnavailable(JobFailed):
    """``job.steps()`` ended without this worker holding the job's final state: the job finished
    while it was behind and neither a peer nor a durable checkpoint could catch it up. Raised
    instead of a normal end, so a loop that saves the model afterwards cannot save a stale one."""

    def __init__(self, worker_id: str, held_step: int, final_step: int, why: str) -> None:
        self.worker_id, self.held_step, self.final_step = worker_id, held_step, final_step
        final = f"the job's final step is {final_step} but " if final_step >= 0 else ""
        super().__init__(
            f"{worker_id}: {final}this worker holds step {held_step} and could not obtain the final state "
            f"({why}); its parameters are NOT the final model. Load the final checkpoint (RUN/checkpoints) or "
            "save the model from a worker whose job.steps() ended normally")


class JobOver(PhalanxError):
    """The coordinator ended this worker's part in the job (it finished while this worker was behind,
    or it shut down). Not a failure of the job; the worker's state is not the final state."""


class StateCorrupt(PhalanxError):
    """Serialized training state failed its checksum or does not decode."""
