# gpu-ready developer entry points. On a fresh machine: `make demo` or `make test` (each sets itself up).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: dev testbin test test-fast lint demo bench chart-lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

## dev: create .venv and install gpu-ready with its development dependencies
dev: $(STAMP)

## testbin: build (once, then cached) kube-apiserver, etcd, helm; extract promtool/prometheus
testbin:
	tools/k8s-testbin/build.sh >/dev/null

## test: every test, against the real kube-apiserver + etcd
test: dev testbin
	$(BIN)/python -m pytest -q

## test-fast: only the tests that need no apiserver
test-fast: dev
	$(BIN)/python -m pytest -q -m "not apiserver"

## lint: ruff + mypy
lint: dev
	$(BIN)/ruff check agent tests bench testkit
	$(BIN)/ruff format --check agent tests bench testkit
	$(BIN)/mypy

## demo: local control plane + simulated GPU node + the real agent: healthy -> ERR! -> Xid 79 -> clear
demo: dev testbin
	$(BIN)/python -m testkit.demo

## bench: the benchmarks in bench/, one summary table
bench: dev testbin
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis *.egg-info
