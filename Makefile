# Two commands do everything on a fresh machine:
#   make demo   -- create .venv, install torch + the package, run the demo on the embedded data set
#   make test   -- same set-up, then lint, the whole test suite and the notebooks in smoke mode
# Tests that need a data set the package does not embed skip where it is absent (pytest.mark.data); .ci/run also runs
# `make suite-without-data`, the suite with every data directory hidden, as a fresh clone without data sees it.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=
BIN := $(VENV)/bin
PYTEST := $(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)
NO_DATA_DIR := $(abspath $(VENV))/no-data
STAMP := $(VENV)/.installed-$(subst =,_,$(subst /,_,$(TORCH_SPEC)))

.PHONY: install demo test suite suite-inductor smoke-notebooks suite-without-data lint format bench notebooks docs clean

install: $(STAMP)

# torch goes first and alone: a bare `torch` requirement with no torch present would pull several GB of CUDA wheels.
$(STAMP): setup.py setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	rm -f $(VENV)/.installed-*
	touch $@

demo: install
	$(BIN)/python -m gpytorch_decoupled demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint suite suite-inductor smoke-notebooks

suite: install
	$(PYTEST) --doctest-modules -m "not inductor" gpytorch_decoupled benchmarks tests

# Compiled training steps with Inductor, the production backend: minutes of compilation on 2 CPU cores, its own step.
suite-inductor: install
	$(PYTEST) -m inductor tests

# Notebooks run top to bottom in their fast smoke mode (the CI environment variable).
smoke-notebooks: install
	CI=$${CI:-true} $(PYTEST) --nbmake notebooks

# Every place data could be found hidden: an empty data directory and download cache, no ../shared/data fallback.
suite-without-data: install
	mkdir -p $(NO_DATA_DIR)
	GPYTORCH_DECOUPLED_DATA=$(NO_DATA_DIR) GPYTORCH_DECOUPLED_CACHE=$(NO_DATA_DIR) GPYTORCH_DECOUPLED_SHARED_FALLBACK=0 \
		$(MAKE) suite

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# make bench NAME=baselines ARGS="--dataset kin40k"  (the harness lives in benchmarks/, outside the package)
bench: install
	$(BIN)/python -m benchmarks $(NAME) $(ARGS)

# Re-execute notebooks in full and store their outputs (the docs render them): make notebooks NB="00_quickstart 06_kernel_selection"
notebooks: install
	$(BIN)/python notebooks/execute.py --threads 1 $(if $(NB),$(foreach nb,$(NB),notebooks/$(nb:.ipynb=).ipynb),)

# HTML in docs/_build/html; warnings are errors, as in CI. The notebooks are rendered from their stored outputs.
docs: install
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache docs/_build docs/notebooks
