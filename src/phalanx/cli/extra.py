"""Subcommands added by later layers (report, sim). Each registers itself here."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    return None
