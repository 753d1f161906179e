# Two commands do everything on a fresh machine:
#   make demo   -- create .venv, install torch + the package, run the demo on the embedded data set
#   make test   -- same set-up, then lint, the whole test suite and the notebooks in smoke mode
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(subst =,_,$(subst /,_,$(TORCH_SPEC)))

.PHONY: install demo test lint format bench docs notebooks clean

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

# Notebooks run top to bottom in their fast smoke mode (the CI environment variable).
test: lint
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --doctest-modules gpytorch_decoupled benchmarks tests
	CI=$${CI:-true} $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --nbmake notebooks

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
