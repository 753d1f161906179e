"""The guides' ``pycon`` examples run as written (doctest), so that they cannot go stale."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

GUIDES = Path(__file__).resolve().parents[2] / "docs" / "guides"


@pytest.mark.parametrize("guide, heading", [("botorch.md", "## Fantasies and conditioning")])
def test_the_example_of_a_guide_section_runs(guide: str, heading: str):
    text = (GUIDES / guide).read_text(encoding="utf-8")
    section = text[text.index(f"\n{heading}\n") :]
    example = re.search(r"```pycon\n(.*?)```", section, re.DOTALL).group(1)
    test = doctest.DocTestParser().get_doctest(example, {}, f"{guide}: {heading}", guide, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0 and runner.tries > 5
