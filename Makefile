# Two commands for a fresh machine (see README):
#   make demo   - install, then run the platform end to end on the embedded bus
#   make test   - install everything the tests need (venv, Python deps, Kafka, Chromium, Prometheus), run them
#                 (the fast tier at the lowest priority beside the slow tier)
#   make test-fast - only the tests that start no process, broker or browser (minutes; while working)
#
# Installs are cached: uv's cache for wheels, .kafka/lib for the broker's jars, a stamp file for
# the virtual environment (re-made only when pyproject.toml changes).

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test test-fast install kafka browser monitoring etcd clean

demo: install
	$(BIN)/resihp demo

# stdin from /dev/null: no process a test starts may wait on the terminal or pipe that ran make.
# Two streams at once (tests/fixtures/tiers.py): the heavy slow tests (torch ranks, agents, demos)
# spend much of their time waiting on the processes they start, and in those gaps the other stream
# runs the fast tier (no process of its own) at the lowest CPU priority, then the light slow tests
# (they only wait on a broker, a browser or Prometheus). The heavy stream's length is the run's.
# The other stream's output is printed when it ends; a failure in any fails the target. Both are in
# this shell's process group, so stopping make stops both.
test: install kafka browser monitoring etcd
	@mkdir -p .resihp
	@( nice -n 19 $(BIN)/python -m pytest --tier fast </dev/null >.resihp/test-fast.log 2>&1; \
	   echo $$? >.resihp/test-fast.rc; \
	   $(BIN)/python -m pytest --tier light --durations=10 </dev/null >.resihp/test-light.log 2>&1; \
	   echo $$? >.resihp/test-light.rc ) & \
	$(BIN)/python -m pytest --tier heavy --durations=25 </dev/null; heavy=$$?; \
	wait; for t in fast light; do echo "--- the $$t tests (.resihp/test-$$t.log)"; cat .resihp/test-$$t.log; done; \
	test "$$(cat .resihp/test-fast.rc)" -eq 0 && test "$$(cat .resihp/test-light.rc)" -eq 0 && test "$$heavy" -eq 0

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

etcd:
	@command -v etcd >/dev/null 2>&1 || { \
	  echo "installing Debian's etcd-server for the multi-node rendezvous tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null) || \
	  { echo "could not install etcd-server (needs root and Debian's package index)"; exit 1; }; }

clean:
	rm -rf $(VENV) .resihp .kafka/broker
