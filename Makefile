# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast sweep bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/phalanx train

test: $(STAMP)
	$(PY) -m pytest -q -ra

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow"

sweep: $(STAMP)
	$(VENV)/bin/phalanx sim sweep --seeds 200

bench: $(STAMP)
	$(PY) -m phalanx.bench training
	$(PY) -m phalanx.bench sim
	$(PY) -m phalanx.bench fidelity
	$(VENV)/bin/phalanx train --compare-modes --fault-plan src/phalanx/faults/plans/straggler.toml --steps 150 --min-step-s 0.05 --quiet --out runs/bench/compare-straggler
	$(VENV)/bin/phalanx train --compare-modes --fault-plan src/phalanx/faults/plans/partition.toml --steps 150 --min-step-s 0.05 --quiet --out runs/bench/compare-partition

clean:
	rm -rf $(VENV) runs
