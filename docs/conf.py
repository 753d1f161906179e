"""Sphinx configuration of the gpytorch_decoupled documentation (``make docs``).

The build needs no network: the notebooks are rendered from their stored outputs (never executed), MathJax is
loaded by the reader's browser, and links to other projects' documentation (intersphinx) are only made when
``GPYTORCH_DECOUPLED_DOCS_INTERSPHINX=1`` asks for them, since fetching their inventories needs the internet.
"""

import os
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "_ext"))

from gpytorch_decoupled.version import __version__  # noqa: E402

project = "gpytorch_decoupled"
author = "gpytorch_decoupled developers"
copyright = "the gpytorch_decoupled developers"
version = release = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_nb",
    "benchmark_numbers",
]
if os.environ.get("GPYTORCH_DECOUPLED_DOCS_INTERSPHINX") == "1":
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://pytorch.org/docs/stable", None),
        "gpytorch": ("https://docs.gpytorch.ai/en/stable", None),
        "linear_operator": ("https://linear-operator.readthedocs.io/en/stable", None),
    }

# The notebooks live in the repository's notebooks/ folder; Sphinx reads only its source folder, so each build copies
# them into docs/notebooks/ (git-ignored) and renders their stored outputs.
_NOTEBOOKS = DOCS / "notebooks"
shutil.rmtree(_NOTEBOOKS, ignore_errors=True)
_NOTEBOOKS.mkdir()
for _notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
    shutil.copy2(_notebook, _NOTEBOOKS / _notebook.name)

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
# Benchmark numbers are read from benchmarks/results/*.json at build time (docs/_ext/benchmark_numbers.py).
benchmark_results_dir = str(ROOT / "benchmarks" / "results")

autodoc_default_options = {"members": True, "show-inheritance": True, "member-order": "bysource"}
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"gpytorch_decoupled {release}"
html_static_path = []
