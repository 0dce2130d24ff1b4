# Two commands for a fresh machine (see README):
#   make demo   - install, then run the platform end to end on the embedded bus
#   make test   - install everything the tests need (venv, Python deps, Kafka, Chromium, Prometheus), run them
#   make test-fast - only the tests that start no process, broker or browser (minutes; while working)
#
# Installs are cached: uv's cache for wheels, .kafka/lib for the broker's jars, a stamp file for
# the virtual environment (re-made only when pyproject.toml changes).

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test test-fast install kafka browser monitoring clean

demo: install
	$(BIN)/resihp demo

# stdin from /dev/null: no process a test starts may wait on the terminal or pipe that ran make.
# The fast tier first (no process, broker, browser or Prometheus: tests/fixtures/tiers.py), then the rest.
test: install kafka browser monitoring
	$(BIN)/python -m pytest --tier fast </dev/null
	$(BIN)/python -m pytest --tier slow --durations=25 </dev/null

test-fast: install
	$(BIN)/python -m pytest --tier fast </dev/null

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m uv --version >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet uv
	test -x $(BIN)/python || $(PYTHON) -m uv venv $(VENV) --python $(PYTHON)
	$(PYTHON) -m uv pip install --python $(BIN)/python --quiet -e '.[dev,torchtitan]'
	touch $(STAMP)

kafka: install
	$(BIN)/python -m infra.broker fetch

browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the real-browser console test"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  { echo "could not install chromium (needs root and Debian's package index)"; exit 1; }; }

monitoring:
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 && \
	  command -v prometheus-alertmanager >/dev/null 2>&1 || { \
	  echo "installing Debian's prometheus and prometheus-alertmanager for the metrics and alerting tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus prometheus-alertmanager >/dev/null) || \
	  { echo "could not install prometheus (needs root and Debian's package index)"; exit 1; }; }

clean:
	rm -rf $(VENV) .resihp .kafka/broker
