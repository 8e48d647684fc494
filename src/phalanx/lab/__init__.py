"""``phalanx lab``: the ideas of distributed systems as experiments on phalanx itself.

Each experiment runs phalanx (real local processes, or the simulator with ``--sim``), once with a
mechanism on and once with it switched off where that is the point, and reports what this run
measured: a table, a paragraph built from the numbers, and ``report.html`` with plots and JSON.
Mechanism switches live in :mod:`phalanx.lab.switches` and are refused outside a lab session.
"""
