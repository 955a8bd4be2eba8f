# The fork's pipeline, one target a step. Each step runs the steps it needs and skips
# what is already done (forkbuild keeps stamps), so any target works on a fresh clone.
#   make serve                 serve the embedded tiny model (CPU) through the fork
#   make test                  everything CI runs
#   make serve MODEL=openai/gpt-oss-20b PRESET=offload-47054    on a GPU host
# Variables: PYTHON (the python3 that starts forkbuild, default python3: its bootstrap needs
#     the standard library alone, makes the tool environment build/tools and runs there)
#   ROUTE=cpu|cuda (fetch, install, regression, model, serve, test; default: cuda with a GPU)
#   serve: PORT (8000) HOST (127.0.0.1) MODEL PRESET CPU_BYTES ARGS (to vllm serve)
#   matrix: VERSIONS="0.26.0 0.33.0"    rebase: VERSION=x.y.z ACCEPT=1
#   gpu-bundle: GPU_HOST=FILE (a host's `bash run.sh --inventory`) PART_MIB=N (56)
# Environment variables, each moving what forkbuild writes:
#   VLLM_FORK_CACHE  the download cache: verified upstream files, uv and its package cache,
#                    bytecode (default ~/.cache/vllm-fork; kept by make clean)
#   VLLM_FORK_BUILD  trees, venvs, models, reports (default build/)
#   VLLM_FORK_TOOLS  forkbuild's own tool environment (default $VLLM_FORK_BUILD/tools)
#   VLLM_FORK_DIST   the wheel of `make wheel` (default dist/)
# Logs: make test writes JUnit XML and pytest logs to build/test-results/ (make matrix too),
#   the embedded models' generator to build/models/*.log, make nightly its reports to
#   build/gpu-nightly/ (FORK_NIGHTLY_OUT), make upstream its proof to dist/upstream/.
# `make clean` removes build/ and dist/ (the download cache ~/.cache/vllm-fork stays).
# More: README.md and docs/.
PYTHON ?= python3
ROUTE ?=
MODEL ?=
PRESET ?=
PORT ?= 8000
HOST ?= 127.0.0.1
ARGS ?=
CPU_BYTES ?=

FORKBUILD := $(PYTHON) -m forkbuild
ROUTE_OPT := $(if $(ROUTE),--route $(ROUTE))

.PHONY: help fetch tree lock install regression wheel model serve test matrix patch-status upstream rebase nightly gpu-bundle generate clean

help:
	@sed -n '/^[^#]/q;p' Makefile | sed 's/^# \{0,1\}//'
	@echo
	@$(FORKBUILD) --help

fetch:
	$(FORKBUILD) fetch $(ROUTE_OPT)

tree:
	$(FORKBUILD) tree

# Regenerates locks/ (needs the package index), the tool environment's too; commit them.
lock:
	$(FORKBUILD) lock

install:
	$(FORKBUILD) install $(ROUTE_OPT)

regression:
	$(FORKBUILD) regression $(ROUTE_OPT)

wheel:
	$(FORKBUILD) wheel

model:
	$(FORKBUILD) model $(ROUTE_OPT)

# FORKBUILD_PORT_OPTION: a busy port's message names the make variable, not --port.
serve:
	FORKBUILD_PORT_OPTION="PORT=N (make serve PORT=8001)" $(FORKBUILD) serve $(ROUTE_OPT) --host $(HOST) --port $(PORT) \
		$(if $(MODEL),--model $(MODEL)) $(if $(PRESET),--preset $(PRESET)) \
		$(if $(CPU_BYTES),--cpu-bytes $(CPU_BYTES)) $(if $(ARGS),-- $(ARGS))

test:
	$(FORKBUILD) test $(ROUTE_OPT)

# Upstream alignment: the suite on stock releases (slow, ~11 min), the DEP-3 claims
# (part of `make test`), the test PRs for vLLM with their proof, a trial rebase.
#   make matrix [VERSIONS="0.26.0 0.33.0"]    make rebase VERSION=0.26.0 [ACCEPT=1]
VERSIONS ?=
VERSION ?=
ACCEPT ?=

matrix:
	$(FORKBUILD) matrix $(VERSIONS)

patch-status:
	$(FORKBUILD) patch-status

upstream:
	$(FORKBUILD) upstream

rebase:
	$(if $(VERSION),,$(error give the upstream version: make rebase VERSION=x.y.z))
	$(FORKBUILD) rebase $(VERSION) $(if $(ACCEPT),--accept)

# The GPU cases for an air-gapped GPU host: dist/gpu-bundle/ (docs/gpu-nightly.md).
GPU_HOST ?=
PART_MIB ?=
gpu-bundle:
	$(FORKBUILD) gpu-bundle $(if $(GPU_HOST),--host $(GPU_HOST)) $(if $(PART_MIB),--part-mib $(PART_MIB))

# The nightly GPU job (.ci/gpu-nightly); refuses at once on a machine without a GPU.
nightly:
	$(FORKBUILD) nightly

# Rewrites the blocks of the docs and the nightly pipeline that restate fork.toml and
# patches/; commit the result (a tool test fails while one is stale).
generate:
	$(FORKBUILD) generate

# Removes what this clone built; the download cache (~/.cache/vllm-fork) is kept.
clean:
	rm -rf build dist
