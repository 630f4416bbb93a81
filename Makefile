# Every target bootstraps .venv idempotently: a fresh machine needs only
# `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast test-compose lint demo bench report report-quick report-loss pretrain clean proto proto-check

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch from the local wheel cache where it exists; a plain
	# `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) scripts/gen_protos.py --check
	$(PY) -m ruff check lemix services gateway profiler tests benchmarks scripts
	$(PY) -m ruff format --check lemix services gateway profiler tests benchmarks scripts
	$(PY) -m mypy lemix services gateway profiler
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not compose" tests

# The suite without the fault-injection tests (tests/faults: real processes
# killed on purpose), the whole-stack tests (tests/e2e) and those marked slow;
# `make test` runs everything.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not faults and not e2e and not slow and not compose" tests

# The compose files for real (tests/compose): scripts/docker_engine.sh readies
# a Docker engine (installs it, starts dockerd, builds local base images, the
# compose plugin; exit 3 = no engine can be had here, and the suite then skips
# with that reason), then the suite builds the image and runs the stack in
# containers, scales it and breaks it. Needs root for the engine's setup.
test-compose: $(STAMP)
	bash scripts/docker_engine.sh up || test $$? -eq 3
	$(PY) -m pytest -q tests/compose

# Regenerate the checked-in stubs in lemix/_proto/ from protos/ (users need no
# protoc). Runs grpc_tools.protoc -I protos --python_out/--grpc_python_out/
# --pyi_out, then rewrites `from lemix.v1 import` to `lemix._proto.lemix.v1`.
proto: $(STAMP)
	$(PY) scripts/gen_protos.py

# Fails when lemix/_proto/ is stale against protos/; `make test` runs it too.
proto-check: $(STAMP)
	$(PY) scripts/gen_protos.py --check

lint: $(STAMP)
	$(PY) -m ruff check lemix services gateway profiler tests benchmarks scripts
	$(PY) -m ruff format --check lemix services gateway profiler tests benchmarks scripts
	$(PY) -m mypy lemix services gateway profiler
	$(VENV)/bin/lint-imports

# The main job (`lemix demo`, lemix/cli/main.py), in three parts: a real model
# live (2 torch executors of tiny-llama on the CPU, co-located LeMix then
# SEPARATE on the same 45 s ShareGPT workload, inference loss side by side);
# the stack at paper scale (2 emulated A100 executors, 20 s of mixed traffic);
# LeMix vs the baselines simulated on identical workloads (3 seeds).
# About three minutes on 2 cores once .venv exists; see docs/cli.md.
demo: $(STAMP)
	$(PY) -m lemix.cli demo --out runs/demo

# Every simulated figure and table (`lemix report`, lemix/cli/report.py):
# Pareto frontiers of goodput vs in-window training on Poisson, long-prompt and
# (when ../shared/traces/azure_llm_conv_2023.csv exists) the Azure trace at
# light / near-saturation / overloaded rates, the throughput/SLO sweeps and the
# ablations, into runs/report/index.md + PNGs. See docs/report.md for timings.
report: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m lemix.cli report --workers 2 --out runs/report

# The same sections with 2 seeds, 30 s windows and fewer points (CI runs it).
report-quick: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m lemix.cli report --quick --workers 2 --out runs/report

# The live loss study the report renders (benchmarks/inference_loss.py): LeMix,
# LeMix with replica sync every 25 training tasks and SEPARATE at K = 10..200,
# 3 seeds, on the pretrained tiny-llama (`make pretrain` first; trains it if
# missing), fine-tuned on HH-RLHF when ../shared/data/hh-rlhf-test.json exists
# (else the packaged ShareGPT pairs). About 50 minutes on 2 cores; then
# `lemix report --from-runs --out runs/report` re-renders the page with it.
HH_TEST := ../shared/data/hh-rlhf-test.json
report-loss: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/inference_loss.py --init pretrained --replica-sync-every 25 \
		$(if $(wildcard $(HH_TEST)),--hh $(HH_TEST)) --out runs/bench/inference_loss

# Pretrain tiny-llama on the packaged ShareGPT text (lemix/model/pretrain.py)
# and cache it under runs/cache/pretrain-<hash>/; a rerun reuses the cache.
# 20 minutes on 2 busy shared cores (2026-12-02); benchmarks/inference_loss.py
# --init pretrained starts from it (and trains it first when it is missing).
pretrain: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) -m lemix.cli.pretrain

bench: $(STAMP)
	$(PY) benchmarks/planner_latency.py --json runs/bench/planner_latency.json
	$(PY) benchmarks/sim_speed.py --json runs/bench/sim_speed.json

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache
