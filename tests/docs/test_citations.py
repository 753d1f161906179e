"""User-facing text cites the papers (author, year, section, equation) or a named section of ``docs/derivations.md``,
never the project's internal specification, which users do not have: no "spec §4.7", "spec eq. 49", "spec A.3",
"spec B.1 table", "spec identity T9", "spec part C" or "the spec's ..." in the package, the benchmark
harness and its results (read by the docs), the notebooks or the docs."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC_CITATION = re.compile(
    r"\bspec(?:'s)?\s*(?:§|eqs?\.|parts?\b|identit(?:y|ies)\b|tables?\b|[ABC]\s?\.?\s?\d)|\bspec's\b|\bthe spec\b",
    re.IGNORECASE,
)
DOCS = [
    path
    for path in (ROOT / "docs").rglob("*")
    if path.suffix in {".md", ".rst", ".py"}
    and not {"_build", "notebooks"} & set(path.relative_to(ROOT / "docs").parts)
]  # docs/_build/ and docs/notebooks/ are build outputs (rendered pages, copies of the notebooks)
USER_FACING = sorted(
    path
    for path in [
        *(ROOT / "gpytorch_decoupled").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
        *(ROOT / "benchmarks" / "results").glob("*.json"),
        *(ROOT / "notebooks").glob("*.ipynb"),
        *DOCS,
    ]
    + [ROOT / "README.md"]
)


@pytest.mark.parametrize("path", USER_FACING, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_internal_spec_citations(path: Path):
    text = path.read_text(encoding="utf-8")
    hits = [
        f"line {text.count(chr(10), 0, match.start()) + 1}: {match.group(0)!r}"
        for match in SPEC_CITATION.finditer(text)
    ]
    assert not hits, (
        f"{path.relative_to(ROOT)} cites the internal spec ({', '.join(hits)}); cite the paper or docs/derivations.md"
    )


@pytest.mark.parametrize(
    "text",
    [
        "(spec §0.1)",
        "spec A.3",
        "(spec eq. 5.3)",
        "spec B.1 table",
        "spec identity T9",
        "spec part C",
        "the spec's B.1",
    ],
)
def test_the_pattern_catches_every_citation_form(text: str):
    assert SPEC_CITATION.search(text)


@pytest.mark.parametrize(
    "text", ["importlib.util.spec_from_file_location", "TORCH_SPEC", "a specific kernel", "respect"]
)
def test_the_pattern_ignores_other_words(text: str):
    assert not SPEC_CITATION.search(text)
