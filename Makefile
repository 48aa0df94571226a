# nanochat_fast: set up, test, benchmark and demo from a fresh clone.
#
#   make test       install into .venv, build the extension, lint, run the C++ and Python tests
#   make lint       ruff: the linter and the formatter's check (`ruff format .` formats)
#   make demo       install, prepare data, train tokenizer + model, mid-train, fine-tune, evaluate, chat,
#                   report card (CPU, within 15 min)
#   make bench      run benchmarks/ and write benchmarks/results.json and benchmarks/RESULTS.md
#   make bench-prepare  preparation of 1 GB of generated text (not part of bench: ~30 min on 2 busy cores):
#                   tokens/s against tiktoken's batch encoder and nanochat's on-the-fly tokenization, peak
#                   RSS against --max-memory-mb, a kill at 50% and its resume -> benchmarks/prep_scale.json
#   make soak       50 two-process runs beside a busy neighbour: exit codes and abort lines -> benchmarks/soak.json
#   make test-gpu   the GPU-only tests (needs a CUDA build of torch, see TORCH_SPEC)
#   make gpu-bundle what the offline GPU node lacks (wheels for its Python, a prepared home) -> build/gpu-bundle
#   make gpu-check  on the GPU node, offline, OUT=DIR: the extension built with CUDA, every kernel checked,
#                   the CUDA benchmarks, a depth-12 run, infer_bench -> DIR/RESULTS-cuda.md (8 minutes)
#   make aot-compat no GPU needed: every Triton kernel variant compiled for sm_80/sm_90/sm_100 by the pinned
#                   Triton and by COMPAT_TRITON (default 3.6.0, the Triton of torch 2.11.0+cu130) in a side
#                   venv, each checked against its target's limits -> benchmarks/compiled.json and the
#                   "Compiled, not run" section of benchmarks/RESULTS.md, both versions side by side. Run it
#                   when a kernel, its configs or the supported Triton versions change (~3 min on 2 cores,
#                   plus ~2 min to set up the side venv the first time).
#
# Run by hand, not by CI, when the torch floor (pyproject.toml's torch>=X), setup.py, csrc/ or the Triton
# kernels change; no GPU needed, both share a venv with PyPI's torch==X (a CUDA build, ~5 GB, its own triton):
#   make test-torch-floor   the CPU suite (python_tests) on the oldest torch we support (7 min of tests
#                           on 2 cores, after a first install of ~4 min)
#   make cuda-build-check   the whole extension built with CUDA (nvcc) as a GPU node builds it:
#                           _C.with_cuda and the CUDA backends listed, and the build time (80 s at 2 jobs)
#
# TORCH_SPEC is the pip requirement for torch. The default is the CPU build this project is
# developed on; on a CUDA machine use e.g.
#   make test-gpu TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" TRITON_SPEC=
# (CUDA wheels of torch bring their own triton; TRITON_SPEC= leaves it alone).

TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.9.0
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# one stamp per torch/triton spec: changing TORCH_SPEC reinstalls torch and rebuilds the extension
STAMP := $(VENV)/.installed-$(shell printf '%s' '$(TORCH_SPEC) $(TRITON_SPEC)' | cksum | cut -d' ' -f1)
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.h csrc/cuda/*.cpp)
PYTEST := OMP_NUM_THREADS=2 $(PY) -m pytest --durations=25

.PHONY: install lint test ctest test-gpu bench-collect gpu-bundle gpu-check aot-compat test-torch-floor cuda-build-check floor-install \
        bench bench-prepare demo kernels soak clean

install: $(STAMP)

# extras: web = chat_web's FastAPI + uvicorn; test = pytest tools, httpx and Playwright, which drives the
# system's Chromium in the browser test (never `playwright install`; .ci/run apt-installs chromium), and
# wandb + tensorboard for the tracking tests (the extras a user installs for --wandb / --tensorboard)
# The extension is built in place (nanochat_fast/_C.so) and every venv of this tree loads it: when
# another venv (another torch, VENV=...) has rebuilt it since this venv's stamp, it is rebuilt for this one.
$(STAMP): $(SOURCES) $(wildcard nanochat_fast/_C.so)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --disable-pip-version-check -q $(TORCH_SPEC) $(TRITON_SPEC)
	$(PIP) install --disable-pip-version-check -q setuptools wheel ninja
	$(PIP) install --disable-pip-version-check -q --no-build-isolation -e ".[test,web]"
	$(PY) -m nanochat_fast.kernels
	touch $@

# The same csrc/ built by CMake against the installed torch, and its C++ test run by ctest.
ctest: install
	mkdir -p build
	cmake -S . -B build/cmake -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV))/bin/ninja \
	    -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')" > build/cmake.log 2>&1 \
	    || (cat build/cmake.log; exit 1)
	cmake --build build/cmake -j2
	ctest --test-dir build/cmake --output-on-failure

# The rules live in pyproject.toml ([tool.ruff]); .pre-commit-config.yaml runs the same before a commit.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: install lint ctest
	$(PYTEST) python_tests

test-gpu: install
	$(PYTEST) python_tests -m gpu

# the benchmarks import their neighbours (harness.py, ...) as top-level modules: pytest's prepend
# import mode, not the importlib mode the test suite runs in
BENCH_PYTEST := -m pytest benchmarks -o python_files='bench_*.py' -p no:cacheprovider --import-mode=prepend
bench: install
	$(PY) $(BENCH_PYTEST) --benchmark-json=benchmarks/results.json --benchmark-columns=median,rounds
	$(PY) benchmarks/make_results.py benchmarks/results.json benchmarks/RESULTS.md

# every benchmark imports and is collected (python_tests/benchmarks/test_bench_collects.py runs it)
bench-collect:
	$(PY) $(BENCH_PYTEST) --collect-only -q

# Preparation at scale: GB of text generated from the built-in corpus (cached under build/prep-scale/), then
# timed, interleaved per shard, and killed and resumed; the figures go to benchmarks/RESULTS.md by hand.
PREP_GB ?= 1
bench-prepare: install
	$(PY) benchmarks/prep_scale.py --gb=$(PREP_GB) --out=benchmarks/prep_scale.json

# The GPU verdict on the GPU node users have: one GPU, its own python3 with torch and triton, no network
# (docs/gpu.md). Here, with the package registries, `make gpu-bundle` writes what the node lacks into
# $(BUNDLE) (wheels for its Python, a prepared home, a manifest); copy it there with the source tree and run
# `make gpu-check OUT=DIR` on the node: every step under its own time cap, the report in DIR. Without a GPU,
# nvcc, a supported torch, a bundle for that Python or OUT, it stops before any work with one line.
GPU_PYTHON ?= 3.12
BUNDLE ?= build/gpu-bundle
GPU_PREFLIGHT = $(shell $(PYTHON) benchmarks/gpu_check.py preflight --bundle $(BUNDLE) $(if $(OUT),--out $(OUT)) 2>&1)
gpu-bundle: install
	$(PY) benchmarks/gpu_bundle.py $(BUNDLE) --python-version $(GPU_PYTHON)

gpu-check:
	$(if $(GPU_PREFLIGHT),$(error $(GPU_PREFLIGHT)))
	$(PYTHON) benchmarks/gpu_check.py check --bundle $(BUNDLE) --out $(OUT)

# Another Triton version's compile of every kernel variant, beside the pinned one's. Its venv has the same CPU
# torch (a CPU torch wheel requires no triton, so pip takes any version) and numpy for the package's imports;
# the package itself comes from this tree (PYTHONPATH). The first compile's failures must not stop the
# second: the table is written either way, naming every variant that does not compile or fit, and the
# second command exits non-zero for them.
COMPAT_TRITON ?= 3.6.0
COMPAT_VENV := .venv-triton-$(COMPAT_TRITON)
COMPAT_RUN := build/aot-compat/triton-$(COMPAT_TRITON).json
$(COMPAT_VENV)/.installed:
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --disable-pip-version-check -q $(TORCH_SPEC) triton==$(COMPAT_TRITON) numpy
	touch $@

aot-compat: install $(COMPAT_VENV)/.installed
	rm -f $(COMPAT_RUN)
	-PYTHONPATH=$(CURDIR) $(COMPAT_VENV)/bin/python benchmarks/compiled_table.py --triton-only $(COMPAT_RUN)
	$(PY) benchmarks/compiled_table.py --add $(COMPAT_RUN)

# The oldest torch we support is pyproject.toml's torch>=X, read by nanochat_fast/core/torch_floor.py; these two
# targets use exactly that torch, so the floor is tested (python_tests/project/test_torch_floor.py checks they
# agree).
# They run in copies of the tree (the build is in place, so a venv with another torch would overwrite the
# CPU .venv's _C.so) sharing one venv, $(FLOOR_DIR)/src/.venv. FLOOR_PYTHON makes that venv (once), e.g.
# FLOOR_PYTHON=python3.12 for the GPU node's Python. On a machine without a GPU a CUDA torch builds the
# extension CPU-only (setup.py), so the suite is the CPU suite. The C++ test (ctest) is left out: CMake's
# find_package(Torch) for a CUDA torch wants the whole CUDA toolkit (cudart, nvrtc, a GPU or an arch list).
TORCH_FLOOR = $(shell $(PYTHON) nanochat_fast/core/torch_floor.py)
FLOOR_TORCH_SPEC = torch==$(TORCH_FLOOR)
FLOOR_PYTHON ?= $(PYTHON)
FLOOR_DIR := build/torch-floor
FLOOR_PY := $(abspath $(FLOOR_DIR)/src/.venv/bin/python)
CUDA_BUILD_DIR := build/cuda-build
floor-install:
	$(PYTHON) benchmarks/stage_tree.py $(FLOOR_DIR)/src
	$(MAKE) -C $(FLOOR_DIR)/src install TORCH_SPEC="$(FLOOR_TORCH_SPEC)" TRITON_SPEC= PYTHON=$(FLOOR_PYTHON)

test-torch-floor: floor-install
	cd $(FLOOR_DIR)/src && OMP_NUM_THREADS=2 $(FLOOR_PY) -m pytest python_tests

# NANOCHAT_FAST_FORCE_CUDA=1 alone, as a GPU-less image build would do it (setup.py picks the GPU targets);
# in its own copy of the tree, so the floor copy's CPU _C.so stays. MAX_JOBS caps the parallel compiles.
cuda-build-check: floor-install
	$(PYTHON) benchmarks/stage_tree.py $(CUDA_BUILD_DIR)/src
	cd $(CUDA_BUILD_DIR)/src && $(FLOOR_PY) benchmarks/cuda_build_check.py

kernels: install
	$(PY) -m nanochat_fast.kernels

SOAK_RUNS ?= 50
SOAK_NAME ?= latest
SOAK_SHARDING ?= fsdp
soak: install
	$(PY) benchmarks/soak_distributed.py --runs=$(SOAK_RUNS) --record=$(SOAK_NAME) --sharding=$(SOAK_SHARDING)

# The whole pipeline on a 2-core CPU within 15 minutes (install included): data (training corpus and
# the benchmark sets), tokenizer, a depth-4 model (5M parameters) pretrained on ~0.8M tokens and scored
# on a sample of the CORE subset, mid-trained and fine-tuned on conversations, scored on 100 ARC-Easy
# and 50 GSM8K questions, a chat, then the report card of the whole pipeline.
# Data, tokenizer and runs go to NANOCHAT_FAST_HOME (default ~/.cache/nanochat_fast).
DEMO_BATCH := --max-seq-len=256 --device-batch-size=16 --total-batch-size=8192 --eval-tokens=32768
demo: install
	$(PY) -m nanochat_fast.scripts.prepare_data --datasets=base,chat,eval
	$(PY) -m nanochat_fast.scripts.tok_train --vocab-size=4096
	$(PY) -m nanochat_fast.scripts.base_train --depth=4 $(DEMO_BATCH) --num-iterations=100 \
	    --eval-every=50 --sample-every=100 --run=demo_base --overwrite
	$(PY) -m nanochat_fast.scripts.base_eval --run=demo_base --eval-tokens=32768 --max-examples=40 --samples=0
	$(PY) -m nanochat_fast.scripts.mid_train $(DEMO_BATCH) --num-iterations=30 --eval-every=30 \
	    --base-run=demo_base --run=demo_mid --overwrite
	$(PY) -m nanochat_fast.scripts.chat_sft --source-run=demo_mid --device-batch-size=8 --num-iterations=30 \
	    --eval-every=30 --eval-tokens=32768 --chat-eval-examples=100 --run=demo_sft --overwrite
	$(PY) -m nanochat_fast.scripts.chat_eval --run=demo_sft --task=ARC-Easy --max-examples=100
	$(PY) -m nanochat_fast.scripts.chat_eval --run=demo_sft --task=GSM8K --max-examples=50
	@echo; echo "--- chat (python -m nanochat_fast.scripts.chat_cli --run=demo_sft for more) ---"
	@for q in "Hi! How are you today?" "What is 3 plus 4?"; do echo "You: $$q"; \
	    $(PY) -m nanochat_fast.scripts.chat_cli --run=demo_sft --temperature=0 --max-tokens=40 --prompt="$$q"; done
	@echo; $(PY) -m nanochat_fast.scripts.report --base-run=demo_base --mid-run=demo_mid --sft-run=demo_sft

clean:
	rm -rf build $(VENV) .venv-triton-* *.egg-info nanochat_fast/_C*.so
