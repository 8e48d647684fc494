# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-all test-fast sweep bench fuzz soak clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/phalanx train
	RUN="$$(ls -td runs/train-* | head -1)" && $(VENV)/bin/phalanx serve --demo "$$RUN" --checkpoint "$$RUN" --demo-duration 15

# `make test`: every case but the long ones (marked slow), in under 15 minutes on 2 cores;
# `make test-slow`: the long ones (CI runs both: every fault path runs in CI); `make test-all`: both.
test: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -ra -m slow

test-all: test test-slow

test-fast: test

fuzz: $(STAMP)
	PHALANX_FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-20000} $(PY) -m pytest -q -ra tests/fuzz

soak: $(STAMP)
	$(VENV)/bin/phalanx soak --duration-s $${SOAK_S:-1800} --quiet

sweep: $(STAMP)
	$(VENV)/bin/phalanx sim sweep --seeds 200 --out runs/sweep/8x40
	$(VENV)/bin/phalanx sim sweep --seeds 300 --workers 4 --steps 60 --max-faults 8 --first-seed 100000 --out runs/sweep/4x60-dense
	$(VENV)/bin/phalanx sim sweep --seeds 200 --workers 2 --steps 40 --first-seed 80000 --out runs/sweep/2x40
	$(VENV)/bin/phalanx sim sweep --seeds 100 --workers 4 --steps 40 --mode local-sgd --first-seed 500 --out runs/sweep/local-sgd
	$(VENV)/bin/phalanx sim sweep --seeds 100 --workers 4 --steps 40 --checkpoint-every 5 --first-seed 700 --out runs/sweep/checkpoints

bench: $(STAMP)
	$(PY) -m phalanx.bench training
	$(PY) -m phalanx.bench sim
	$(PY) -m phalanx.bench fidelity
	$(VENV)/bin/phalanx train --compare-modes --fault-plan src/phalanx/faults/plans/straggler.toml --steps 150 --min-step-s 0.05 --quiet --out runs/bench/compare-straggler
	$(VENV)/bin/phalanx train --compare-modes --fault-plan src/phalanx/faults/plans/partition.toml --steps 150 --min-step-s 0.05 --quiet --out runs/bench/compare-partition

clean:
	rm -rf $(VENV) runs
