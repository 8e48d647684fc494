"""Domain identifiers. NewTypes keep worker ids, quorum ids and step numbers apart in type checks."""

from __future__ import annotations

from typing import NewType

WorkerId = NewType("WorkerId", str)
QuorumId = NewType("QuorumId", int)  # the epoch; also the fencing token
Step = NewType("Step", int)

NO_QUORUM = QuorumId(0)  # no quorum has been seen yet; real quorum ids start at 1
NO_STEP = Step(-1)  # nothing committed yet
