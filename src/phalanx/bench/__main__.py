"""`python -m phalanx.bench training|sim|fidelity|serving|transport|teardown`: benchmarks that compare phalanx with a peer in one run."""

from __future__ import annotations

import sys


def main() -> int:
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    rest = sys.argv[2:]
    if which == "training":
        from phalanx.bench.training import main as run
    elif which == "sim":
        from phalanx.bench.sim_events import main as run  # type: ignore[no-redef]
    elif which == "fidelity":
        from phalanx.bench.fidelity import main as run  # type: ignore[no-redef]
    elif which == "serving":
        from phalanx.bench.serving import main as run  # type: ignore[no-redef]
    elif which == "transport":
        from phalanx.bench.transport_rtt import main as run  # type: ignore[no-redef]
    elif which == "teardown":
        from phalanx.bench.heap_teardown import main as run  # type: ignore[no-redef]
    else:
        print("usage: python -m phalanx.bench training|sim|fidelity|serving|transport|teardown [options]", file=sys.stderr)
        return 2
    sys.argv = [f"phalanx.bench.{which}", *rest]
    return int(run() or 0)


if __name__ == "__main__":
    sys.exit(main())
