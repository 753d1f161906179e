"""The notebooks' stored outputs are what users read on the documentation site (rendered, never re-executed), so they
must be trustworthy on their own: the outputs of one clean top-to-bottom run, without errors, object reprs, memory
addresses or paths of the machine that ran them, with a figure wherever a cell draws one (axes labelled), and with
every number quoted in the text equal to an output of the notebook.

These tests read the ``.ipynb`` JSON only; ``make test`` also executes the notebooks in their smoke mode (nbmake),
and ``make notebooks`` re-executes them fully and writes outputs in the form checked here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FIX = "re-execute it with `make notebooks NB=<name>` (notebooks/execute.py)"

# An object's default repr (`<torch._C.Generator at 0x7f...>`) or any other memory address.
ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+|\b0x[0-9a-fA-F]{8,}\b")
# Paths of the machine that ran the notebook: home and work folders, virtual environments, installed packages.
MACHINE_PATH = re.compile(
    r"(?:^|[\s'\"(=])/(?:work|root|home|Users|tmp|opt|usr|var|private|mnt|srv)/|[A-Za-z]:\\|site-packages|\.venv\b",
    re.MULTILINE,
)
# Widgets (tqdm.auto progress bars) need the live widget state: the rendered page shows nothing, or a model id.
WIDGET = "application/vnd.jupyter.widget-view+json"
PLOTTING = re.compile(r"\bplt\.|\.subplots\(|\.plot\(|\.scatter\(|\.hist\(|\.errorbar\(|\.semilogy\(|\.imshow\(")

# Numbers the text quotes that no cell computes: values from the papers' tables, with where they come from.
LITERATURE = {
    "03_decoupled_and_hybrid.ipynb": {
        "0.037": "Cheng & Boots (2017), KUKA table: SVDGP's nMSE",
        "0.169": "Cheng & Boots (2017), KUKA table: SVI's nMSE",
    },
}
# A quoted number: optionally signed (also with U+2212), thousands separated by commas, optionally decimal.
NUMBER = re.compile(
    r"(?<![\w.^{}_\\])[−-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)"  # 16,599 or 1,353.5
    r"|(?<![\w.^{}_\\])[−-]?\d+(?:\.\d+)?(?![\d.]\d)"  # 340, 0.046, 1.3 in 1.3x
)
SCIENTIFIC = re.compile(r"[−-]?\d+(?:\.\d+)?e[−+-]?\d+")
# Where a number is not a result: equations, links, references to the literature and to GitHub issues, years.
NOT_RESULTS = [
    re.compile(r"\$\$.*?\$\$", re.DOTALL),
    re.compile(r"\$[^$]*\$"),
    re.compile(r"\]\([^)]*\)"),
    re.compile(r"`[^`]*`"),
    re.compile(r"(?:eqs?\.|Sec\.|Secs\.|Fig\.|Figs\.|Table|Algorithm|Proposition|App\.|#)\s*[\dA-Z][\d.,–-]*"),
    re.compile(r"\b(?:19|20)\d\d\b(?![.,]\d)"),
    re.compile(r"\bnotebooks?\s+\d+(?:\s*(?:,|and|to|–|-)\s*\d+)*", re.IGNORECASE),  # "notebooks 02 to 06"
]


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def output_texts(notebook: dict) -> list[str]:
    """The text of every stored output (streams, results, errors), images left out."""
    texts = []
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            if output["output_type"] == "stream":
                texts.append("".join(output["text"]))
            elif output["output_type"] == "error":
                texts.append("\n".join(output.get("traceback", [])))
            for mime, value in output.get("data", {}).items():
                if not mime.startswith("image/"):
                    texts.append(value if isinstance(value, str) else "".join(value) if isinstance(value, list) else "")
    return texts


def quoted_numbers(markdown: str) -> list[str]:
    """The numbers a markdown cell quotes as results: at least two digits or a decimal point, outside equations,
    code, links, citations and years."""
    for pattern in NOT_RESULTS:
        markdown = pattern.sub(" ", markdown)
    found = []
    for match in NUMBER.finditer(markdown):
        text = match.group(0)
        digits = text.lstrip("−-").replace(",", "")
        if "." in digits or len(digits) >= 2:
            found.append(text)
    return found


def computed_values(notebook: dict) -> list[float]:
    """Every number in the outputs and in the code (settings such as a learning rate may be quoted too)."""
    text = "\n".join(output_texts(notebook) + [source(c) for c in notebook["cells"] if c["cell_type"] == "code"])
    values = [float(s.replace("−", "-")) for s in SCIENTIFIC.findall(text)]
    text = SCIENTIFIC.sub(" ", text)
    values += [float(s.replace("−", "-").replace(",", "")) for s in NUMBER.findall(text)]
    return values


def unmatched_numbers(notebook: dict, exceptions: set[str] = frozenset()) -> list[str]:
    """The numbers of the markdown cells that equal no output or code number at the precision they are quoted with
    (a quoted 0.21 matches a printed 0.2094; a quoted 32% matches 0.316)."""
    values = [abs(v) for v in computed_values(notebook)]
    missing = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for text in quoted_numbers(source(cell)):
            if text.lstrip("−-") in exceptions:
                continue
            number = text.lstrip("−-").replace(",", "")
            quoted = float(number)
            tolerance = 0.5 * 10 ** -(len(number.split(".")[1]) if "." in number else 0) * (1 + 1e-9)
            if not any(abs(v - quoted) <= tolerance or abs(100 * v - quoted) <= tolerance for v in values):
                missing.append(text)
    return missing


def problems(notebook: dict, exceptions: set[str] = frozenset()) -> list[str]:
    """Everything that makes the stored outputs untrustworthy, one line each."""
    found = []
    code_cells = [c for c in notebook["cells"] if c["cell_type"] == "code" and source(c).strip()]
    counts = [c.get("execution_count") for c in code_cells]
    if counts != list(range(1, len(code_cells) + 1)):
        found.append(f"not one top-to-bottom run: execution counts {counts}")
    for number, cell in enumerate(notebook["cells"]):
        where = f"cell {number}"
        if "execution" in cell.get("metadata", {}) or "ExecuteTime" in cell.get("metadata", {}):
            found.append(f"{where}: execution timestamps in its metadata")
        if cell["cell_type"] != "code":
            continue
        outputs = cell.get("outputs", [])
        for output in outputs:
            if output["output_type"] == "error":
                found.append(f"{where}: an error output ({output.get('ename')})")
            if WIDGET in output.get("data", {}):
                found.append(f"{where}: a widget output (a progress bar?) that the documentation cannot render")
        text = "\n".join(output_texts({"cells": [cell]}))
        found += [f"{where}: a memory address {m.group(0)!r} in its output" for m in ADDRESS.finditer(text)]
        found += [f"{where}: a machine path {m.group(0).strip()!r} in its output" for m in MACHINE_PATH.finditer(text)]
        code = source(cell)
        if PLOTTING.search(code):
            if not any(k.startswith("image/") for o in outputs for k in o.get("data", {})):
                found.append(f"{where}: draws a figure but stores no image")
            if not (re.search(r"xlabel", code) and re.search(r"ylabel", code)):
                found.append(f"{where}: a figure without an x and a y axis label")
            if "label=" in code and "legend(" not in code:
                found.append(f"{where}: labelled curves but no legend")
    found += [f"the text quotes {n}, which no output shows" for n in unmatched_numbers(notebook, exceptions)]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_stored_outputs_are_trustworthy(path: Path):
    found = problems(load(path), set(LITERATURE.get(path.name, {})))
    assert not found, f"{path.name}: " + "; ".join(found) + f". Fix the notebook, then {FIX}."


def test_every_notebook_is_checked():
    assert len(NOTEBOOKS) >= 6 and set(LITERATURE) <= {path.name for path in NOTEBOOKS}


def notebook_of(*cells: dict) -> dict:
    return {"cells": list(cells), "metadata": {}}


def code_cell(code: str, count: int, *outputs: dict) -> dict:
    return {"cell_type": "code", "source": code, "execution_count": count, "metadata": {}, "outputs": list(outputs)}


def markdown_cell(text: str) -> dict:
    return {"cell_type": "markdown", "source": text, "metadata": {}}


def stdout(text: str) -> dict:
    return {"output_type": "stream", "name": "stdout", "text": text}


def figure() -> dict:
    return {"output_type": "display_data", "data": {"image/png": "iVBOR", "text/plain": "<Figure>"}, "metadata": {}}


def test_the_checks_catch_what_the_old_notebooks_had():
    generator = {"output_type": "execute_result", "data": {"text/plain": "<torch._C.Generator at 0x7f85dd119630>"}}
    warning = {
        "output_type": "stream",
        "name": "stderr",
        "text": "/work/main/.venv/lib/python3.11/site-packages/linear_operator/utils/sparse.py:52: UserWarning",
    }
    unlabelled = code_cell("plt.plot(losses)", 3)  # no axis labels, and no image stored
    numbers = code_cell("print(table)", 4, stdout("SVGP 4.3 ms, Decoupled 208.7 ms, Hybrid 250.7 ms"))
    found = problems(
        notebook_of(
            code_cell("torch.manual_seed(0)", 1, generator),
            code_cell("run()", 2, warning),
            unlabelled,
            numbers,
            markdown_cell("*Per second, SVGP wins by far*: about 6 ms per step against about 340 ms."),
        )
    )
    assert any("memory address" in line for line in found)
    assert any("machine path '/work/" in line for line in found)
    assert any("draws a figure but stores no image" in line for line in found)
    assert any("without an x and a y axis label" in line for line in found)
    assert "the text quotes 340, which no output shows" in found


def test_a_clean_notebook_passes():
    plot = "plt.plot(t, y, label='a')\nplt.xlabel('time (s)')\nplt.ylabel('NLL')\nplt.legend();"
    clean = notebook_of(
        code_cell("torch.manual_seed(0);", 1),
        code_cell(plot, 2, figure()),
        code_cell("print(rate)", 3, stdout("RMSE 0.2094, NLL -0.073, 1.31x, coverage 0.316, 36000 rows")),
        markdown_cell(
            "RMSE 0.21 and NLL −0.07 after 1,500 steps of `lr=0.03` (Salimbeni et al. 2018, eq. 13; #1269); 1.3x "
            "faster, 32% coverage, 36,000 rows, $M=2000$ points."
        ),
    )
    assert problems(clean) == ["the text quotes 1,500, which no output shows"]
    assert problems(clean, {"1,500"}) == []


def test_execution_counts_must_come_from_one_run():
    twice = notebook_of(code_cell("a = 1", 1), code_cell("b = 2", 5))
    assert problems(twice) == ["not one top-to-bottom run: execution counts [1, 5]"]


@pytest.mark.parametrize(
    "text, numbers",
    [
        ("after 600 steps the nMSE is 0.046 (SVGP 0.044)", ["600", "0.046", "0.044"]),
        ("−0.838 against −0.878", ["−0.838", "−0.878"]),
        ("Fig. 3, eq. 40, Sec. 3.2, Table 2, #1823, in 2016 and 1958–2010", []),
        ("$3\\cdot10^{-12}$ and $M_\\gamma = 2000$ and `num_kl_columns=64`", []),
        ("5 of 6 sets, 16,599 rows", ["16,599"]),
        ("notebooks 02 to 06 and notebook 04; 12 notebooks", ["12"]),
    ],
)
def test_quoted_numbers(text: str, numbers: list[str]):
    assert quoted_numbers(text) == numbers


def test_make_notebooks_stores_outputs_without_timestamps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import importlib.util

    import nbformat

    spec = importlib.util.spec_from_file_location("execute_notebooks", ROOT / "notebooks" / "execute.py")
    execute_notebooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(execute_notebooks)
    path = tmp_path / "tiny.ipynb"
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("import os\nprint('smoke' if 'CI' in os.environ else 'full', 6 * 7)")]
    nbformat.write(notebook, path)
    monkeypatch.setenv("CI", "true")
    execute_notebooks.main([str(path)])
    stored = load(path)
    assert "".join(stored["cells"][0]["outputs"][0]["text"]) == "full 42\n"  # a full run: the smoke switch is removed
    assert problems(stored) == []
