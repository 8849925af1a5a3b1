"""Figures in the docs that cite a result file equal that file.

A table in ``README.md`` or ``docs/*.md`` preceded by ``<!-- figures: benchmarks/results/<name>.json KEY.KEY -->``
cites the object at that path inside the result file (``benchmarks/results.py`` writes them).
Either each row names a key of that object and each column a key of the row's object, or the
table has the columns ``figure | value`` and each row names a key of the object itself. Every
number in the table must equal the cited figure as rounded to the digits the table prints.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TAG = re.compile(r"^<!-- figures: (\S+\.json)(?: (\S+))? -->$")
NUMBER = re.compile(r"^-?[\d,]*\.?\d+(?:e-?\d+)?%?x?$")


def tagged_tables(text: str):
    """(result file, key path, header, rows, line number) for every tagged table of a page."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = TAG.match(line.strip())
        if not m:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        table = []
        while j < len(lines) and lines[j].strip().startswith("|"):
            table.append([c.strip() for c in lines[j].strip().strip("|").split("|")])
            j += 1
        assert len(table) >= 3, f"line {i + 1}: the figures tag is not followed by a table"
        yield m.group(1), m.group(2) or "", table[0], table[2:], i + 1


def cell_matches(cell: str, value) -> bool:
    """The cell's number equals ``value`` rounded to the cell's digits (``12.5%`` is 0.125)."""
    text = cell.replace(",", "").rstrip("x")
    percent = text.endswith("%")
    text = text.rstrip("%")
    shown = float(text)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    want = value * 100 if percent else value
    if "e" in text:
        return abs(shown - want) <= abs(want) * 0.05 + 1e-30
    digits = len(text.split(".")[1]) if "." in text else 0
    return round(want, digits) == pytest.approx(shown, abs=10 ** -(digits + 3))


def check_table(result: dict, key_path: str, header: list[str], rows: list[list[str]], where: str) -> list[str]:
    obj = result
    for key in filter(None, key_path.split(".")):
        obj = obj[key]
    problems = []
    flat = [h.lower() for h in header[:2]] == ["figure", "value"]
    for row in rows:
        for column, cell in list(zip(header, row))[1:]:
            if not NUMBER.match(cell.replace(" ", "")):
                continue
            try:
                value = obj[row[0]] if flat else obj[row[0]][column]
            except (KeyError, TypeError):
                problems.append(f"{where}: row {row[0]!r}, column {column!r}: not in the result file")
                continue
            if not cell_matches(cell.replace(" ", ""), value):
                problems.append(f"{where}: row {row[0]!r}, column {column!r}: the docs say {cell}, the result file {value}")
    return problems


def all_tagged():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for path, key_path, header, rows, line in tagged_tables(page.read_text()):
            yield page, path, key_path, header, rows, line


def test_every_tagged_figure_equals_its_result_file():
    problems, checked = [], 0
    for page, path, key_path, header, rows, line in all_tagged():
        where = f"{page.relative_to(ROOT)}:{line}"
        result_file = ROOT / path
        if not result_file.is_file():
            problems.append(f"{where}: cites {path}, which does not exist")
            continue
        figures = json.loads(result_file.read_text())["figures"]
        problems += check_table(figures, key_path, header, rows, where)
        checked += 1
    assert not problems, "\n".join(problems)
    assert checked, "no docs table cites a result file"


def test_every_result_file_names_its_conditions():
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        assert {"commit", "machine", "load", "date"} <= set(data["conditions"]), path.name
        assert data["figures"], path.name


def test_the_check_catches_a_figure_that_differs(tmp_path):
    result = {"rows": {"a": {"tokens/s": 145.26, "share": 0.9652}}}
    header, rows = ["row", "tokens/s", "share"], [["a", "145.3", "96.5%"]]
    assert check_table(result, "rows", header, rows, "page") == []
    stale = check_table(result, "rows", header, [["a", "150.0", "96.5%"]], "page")
    assert stale == ["page: row 'a', column 'tokens/s': the docs say 150.0, the result file 145.26"]
    assert check_table({"x": 2.0}, "", ["figure", "value"], [["x", "2.00"]], "page") == []
