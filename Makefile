# branch-settlement: every entry point a developer or CI needs.
# `make demo` and `make test` work from a fresh clone: they install what they need first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-unit verify broker kafka-up kafka-down kafka-status kafka-secure-up kafka-secure-down kafka-secure-status bench bench-quick bench-fold bench-replay faults clean

install: $(STAMP)

# The compiled hot path (native/, Rust with PyO3, built by pip with maturin) where a Rust toolchain is; without one
# the pure-Python implementation runs (docs/implementations.md). SETTLE_NATIVE=0 skips the build.
NATIVE_SOURCES := native/Cargo.toml native/Cargo.lock native/pyproject.toml $(wildcard native/src/*.rs)
SETTLE_NATIVE ?= 1

$(STAMP): pyproject.toml $(NATIVE_SOURCES)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	@if [ "$(SETTLE_NATIVE)" = 0 ]; then \
		echo "make install: SETTLE_NATIVE=0, the pure-Python implementation only"; \
	elif command -v cargo >/dev/null 2>&1; then \
		echo "make install: building the compiled hot path (native/, about 2 minutes the first time)"; \
		$(BIN)/pip install --quiet ./native; \
	else \
		echo "make install: no Rust toolchain (cargo), so the pure-Python implementation only (docs/implementations.md)"; \
	fi
	@touch $(STAMP)

demo: install broker
	$(BIN)/python -m branch_settlement.processors.kafka.demo

test: install broker
	$(BIN)/pytest

test-unit: install
	$(BIN)/pytest -m unit

# The bounded exhaustive check of the fold, deeper than `make test` runs it (tests/ledger/exhaustive.py).
DEPTH ?= 5
verify: install
	$(BIN)/python -m tests.ledger.exhaustive --depth $(DEPTH)

# The cluster SETTLE_BOOTSTRAP_SERVERS names (default 127.0.0.1:9092) when it answers; else the local broker there.
broker: install
	@bash deploy/broker.sh

kafka-up:
	@bash deploy/kafka.sh up

kafka-down:
	@bash deploy/kafka.sh down

kafka-status:
	@bash deploy/kafka.sh status

# The secured broker (docs/security.md): SASL_SSL on 9192, mutual TLS on 9193, ACLs enforced. `make test` needs
# no running one: tests/kafka/test_secured_broker.py starts its own with the same script, on free ports.
kafka-secure-up:
	@bash deploy/kafka-secure.sh up

kafka-secure-down:
	@bash deploy/kafka-secure.sh down

kafka-secure-status:
	@bash deploy/kafka-secure.sh status

bench-fold: install
	$(BIN)/python bench/fold.py

bench: install kafka-up
	$(BIN)/python bench/run.py

bench-quick: install kafka-up
	$(BIN)/python bench/run.py --quick

# Both replays against the live processor on the same input, side by side (the target: at least twice as fast).
bench-replay: install kafka-up
	$(BIN)/python bench/replay_ratio.py --repeat 2

faults: install kafka-up
	$(BIN)/python -m faults.run

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis native/target
