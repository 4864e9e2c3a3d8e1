# Two entry points: `make demo` (a real 2-slot training with its time-cost report) and `make test`.
# Both create .venv on first use and install dtrain with our pinned versions (constraints.txt).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SLOTS ?= 2

.PHONY: demo test test-quick lint venv clean

venv: $(STAMP)

# The install runs through uv (pinned in constraints.txt, itself installed by pip): it fetches and
# unpacks the ~90 wheels in parallel, where pip takes them one at a time, in about a third of pip's time here.
# uv reads neither pip's config nor its PIP_* variables, so pip's find-links (where a machine keeps its own
# torch build, as this one does) are handed on. Should uv be unavailable, pip installs the same pins.
# --compile-bytecode: as pip does, so that no test process compiles torch's modules at import. Leaving it to the
# first import instead was no faster here: the suite's first processes all compiled torch at once.
UV_FIND_LINKS_ARGS := $(foreach place,$(PIP_FIND_LINKS),--find-links $(place))
# An editable install leaves dtrain's own modules uncompiled, and a machine may forbid writing bytecode at import
# (PYTHONDONTWRITEBYTECODE, as this one does): every process would compile the ~120 modules it imports, about
# 0.15 s of CPU each time. compileall writes them once (and again only for files changed since).
COMPILE_SOURCE := $(BIN)/python -m compileall -q src tests

# The venv is made without pip (ensurepip alone took longer than any other step but the install), uv is put in
# it by this Python's pip, and uv then installs pip too, for the venv's users. Without a pip here, or should
# uv fail, the venv gets its own pip and installs the same pins.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv --without-pip $(VENV)
	($(PY) -m pip --python $(BIN)/python install -q -c constraints.txt uv \
	  && $(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode $(UV_FIND_LINKS_ARGS) \
	     -c constraints.txt -e ".[dev]" pip) \
	|| ($(BIN)/python -m ensurepip >/dev/null && $(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]")
	touch $(STAMP)

demo: $(STAMP)
	@$(COMPILE_SOURCE) >/dev/null
	$(BIN)/dtrain run examples/digits/experiment.yaml --slots $(SLOTS)
	@echo "dtrain is installed in $(VENV): run 'source $(VENV)/bin/activate' for the dtrain command (or use $(BIN)/dtrain)"

# Two pytest processes (pytest-xdist); whole files go to one process, so a module's shared reference runs
# are trained once (--dist loadfile), in tests/conftest.py's order: files with the most multi-process tests
# first, so that neither process ends working alone. Deadlines and the doctor's planted bottlenecks run here
# too: their margins hold under this load (measured). Three processes keep the cores busier (96% against 88%,
# 2026-12-07) and ended sooner, but stretched two tests past 30 s. The one speed comparison (marker `timing`)
# needs a quiet machine and is left out: `DTRAIN_TIMING_TESTS=1 .venv/bin/python -m pytest -m timing` runs it.
# At the end: the ten slowest tests, then seconds per file and any test over 30 s (tests/conftest.py).
# Beside compiling dtrain's source, on the other core: pytest's cache of the test modules it rewrites (the two
# pytest processes would each rewrite them all again: scripts/pytest_rewrite_cache.py says why).
test: $(STAMP)
	$(BIN)/python -m ruff check src tests bench examples
	@$(COMPILE_SOURCE) >/dev/null & $(BIN)/python scripts/pytest_rewrite_cache.py tests; wait
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not timing" --durations=10

test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/python -m ruff check src tests bench examples

clean:
	rm -rf $(VENV) runs build src/*.egg-info
