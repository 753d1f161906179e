"""The ``bench`` role: a number read from a committed benchmark result at build time.

``{bench}`orthogonal-speed:ratios.orthnat_time_per_iteration``` renders the value at that dotted path of
``benchmarks/results/orthogonal-speed.json`` (list items by index), to three significant figures (integers in
full), as an abbreviation whose tooltip names the file and the path. ``|.2f`` after the path picks another format
and ``|%`` a percentage. Rerunning a benchmark updates every page that quotes it; a path that no longer exists fails
the build (it is an error, and the docs build turns warnings into errors too), so a renamed result can never leave a
stale number behind.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxRole


@cache
def _load(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _lookup(data: object, dotted: str) -> object:
    for part in dotted.split("."):
        if isinstance(data, list):
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            raise KeyError(part)
    return data


class BenchmarkNumber(SphinxRole):
    def run(self) -> tuple[list[nodes.Node], list[nodes.system_message]]:
        target, _, spec = self.text.partition("|")
        name, _, dotted = target.strip().partition(":")
        path = Path(self.config.benchmark_results_dir) / f"{name}.json"
        source = f"benchmarks/results/{name}.json: {dotted}"
        try:
            value = _lookup(_load(str(path)), dotted)
        except (OSError, ValueError, KeyError, IndexError) as error:
            message = self.inliner.reporter.error(f"bench: cannot read {source} ({error!r})", line=self.lineno)
            return [self.inliner.problematic(self.rawtext, self.rawtext, message)], [message]
        spec = spec.strip()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            text = str(value)
        elif spec == "%":
            text = f"{100 * value:.0f}%"
        elif not spec and isinstance(value, int):
            text = f"{value:,}"
        else:
            text = format(value, spec or ".3g")
        return [nodes.abbreviation(text, text, explanation=source)], []


def setup(app: Sphinx) -> dict:
    app.add_config_value("benchmark_results_dir", "", "env")
    app.add_role("bench", BenchmarkNumber())
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
