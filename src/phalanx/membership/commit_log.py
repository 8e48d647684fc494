"""Commits across coordinator incarnations, merged once for real runs and the simulator."""

from __future__ import annotations

from phalanx.membership.coordinator_state import CommitRecord

__all__ = ["CommitRecord", "merge_commits"]


def merge_commits(incarnations: list[list[CommitRecord]]) -> tuple[list[CommitRecord], list[CommitRecord]]:
    """One commit list over coordinator incarnations (oldest first), and the records superseded.

    A crash can fall after the coordinator recorded a commit but before any worker heard of it:
    every worker then rolls that step back and the next incarnation commits it again. The later
    record is the one the workers acted on, so it replaces the earlier one.
    """
    merged: list[CommitRecord] = []
    superseded: list[CommitRecord] = []
    for commits in incarnations:
        if commits:
            first = commits[0].step
            superseded += [c for c in merged if c.step >= first]
            merged = [c for c in merged if c.step < first]
        merged += commits
    steps = [c.step for c in merged]
    assert steps == sorted(set(steps)), f"commits across coordinator incarnations go up by one: {steps[:20]}"
    return merged, superseded
