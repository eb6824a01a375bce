"""docs/performance.md keeps its shape (issue 98): one table per area, one row per figure, each row with what was
measured, its value, a calendar date, a command that names a script under bench/ (with flags that script or
resumerge's own command line knows), and the peer's figure; and the other pages' links into it land on a heading."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "performance.md"
COLUMNS = ["what", "value", "date", "command", "peer"]
_DATE = re.compile(r"^20\d\d-\d\d-\d\d\b")
_SCRIPT = re.compile(r"\bbench/([\w.-]+\.py)\b")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_LINK = re.compile(r"\((?:[./]*docs/)?performance\.md#([^)\s]+)\)")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Each table of ``text``: the ``##`` area it is under, its header cells and its rows' cells."""
    lines, area, found, at = text.splitlines(), "", [], 0
    while at < len(lines):
        if lines[at].startswith("## "):
            area = lines[at][3:]
        if lines[at].startswith("|") and at + 1 < len(lines) and re.match(r"\|\s*-", lines[at + 1]):
            end = at + 2
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            found.append((area, _cells(lines[at]), [_cells(row) for row in lines[at + 2:end]]))
            at = end
            continue
        at += 1
    return found


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _known_flags(scripts: list[str]) -> str:
    """The text a command's flags must appear in: its scripts' sources and resumerge's command line."""
    sources = [(ROOT / "bench" / name).read_text() for name in scripts]
    sources += [path.read_text() for path in sorted((ROOT / "resumerge" / "cli").glob("*.py"))]
    return "\n".join(sources)


def test_each_area_has_one_table_with_the_five_columns() -> None:
    tables = _tables(PAGE.read_text())
    assert tables
    areas = [area for area, _, _ in tables]
    assert len(areas) == len(set(areas)), f"an area with more than one table: {areas}"
    for area, header, rows in tables:
        assert [cell.lower() for cell in header] == COLUMNS, f"{area}: columns {header}"
        assert rows, f"{area}: a table without rows"
        for row in rows:
            assert len(row) == len(COLUMNS), f"{area}: a row of {len(row)} cells: {row}"


def test_every_row_has_a_date_a_bench_command_with_real_flags_and_a_peer() -> None:
    problems = []
    for area, _, rows in _tables(PAGE.read_text()):
        scripts: list[str] = []
        for row in rows:
            if len(row) != len(COLUMNS):
                problems.append(f"{area}: a row of {len(row)} cells, not {len(COLUMNS)}: {row[0][:60]}")
                continue
            what, value, date, command, peer = row
            where = f"{area} / {what[:60]}"
            if not _DATE.match(date):
                problems.append(f"{where}: date {date!r} is not a calendar date")
            if not value or not peer:
                problems.append(f"{where}: an empty value or peer")
            named = _SCRIPT.findall(command)
            if named:
                scripts = named
            elif not command.startswith("the same") or not scripts:
                problems.append(f"{where}: command {command!r} names no bench/ script")
                continue
            problems += [f"{where}: bench/{name} does not exist" for name in named
                         if not (ROOT / "bench" / name).is_file()]
            if all((ROOT / "bench" / name).is_file() for name in scripts):
                known = _known_flags(scripts)
                problems += [f"{where}: {flag} is neither {', '.join(scripts)}'s nor resumerge's"
                             for flag in _FLAG.findall(command) if flag not in known]
    assert not problems, "\n".join(problems)


def test_links_into_the_page_land_on_a_heading() -> None:
    anchors = {_slug(line.lstrip("#")) for line in PAGE.read_text().splitlines() if line.startswith("#")}
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [f"{page.relative_to(ROOT)}: #{anchor}" for page in pages
              for anchor in _LINK.findall(page.read_text()) if anchor not in anchors]
    assert not broken, broken
