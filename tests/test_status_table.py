"""docs/status.md's table (README's first screen links it): each promise and where it was verified, kept in
step with the presets and with what the docs say was measured on a GPU.

Cells are read as they render: a GPU cell with a date names a GPU run, and its linked doc must hold that
date and card; a "predicted / not yet run" cell must link a doc section that says so; every link
resolves to a file (relative to docs/) and, with ``#anchor``, to one of its headings (GitHub's anchor rules)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
STATUS = ROOT / "docs" / "status.md"
FIRST_SCREEN = 40  # README's lines
DATE = re.compile(r"\b(\d{4}-\d{2}-\d{2})\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
NOT_RUN = re.compile(r"predicted|not yet run", re.I)
# How a doc section says nothing there ran on a GPU.
SAYS_NOT_RUN = re.compile(r"not run on a GPU|not measured on a GPU|none of it (?:has run|measured) on a GPU|"
                          r"no GPU has run|nothing here ran on a GPU|no multi-GPU run|never measured on a GPU|"
                          r"has not run on a GPU|none of it has run on a GPU machine|predictions?\b", re.I)
# A doc's statement of a GPU measurement: "measured on an NVIDIA H200 (...; 2026-11-30)".
GPU_MEASURED = re.compile(r"measured\W+on (?:an? )?NVIDIA (?:GeForce |Tesla )?([\w-]+(?: [\w-]*\d[\w-]*)?).{0,200}?"
                          r"(\d{4}-\d{2}-\d{2})",
                          re.I | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(path: Path) -> dict[str, str]:
    """``{anchor: the text under that heading, up to the next heading}`` of a markdown file."""
    out, anchor, lines = {}, "", []
    for line in path.read_text().splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            out[anchor] = "\n".join(lines)
            anchor, lines = slug(match.group(1)), []
        lines.append(line)
    out[anchor] = "\n".join(lines)
    return out


def table() -> tuple[int, list[dict[str, str]]]:
    """(the line the table ends on, its rows as {column: cell}) of the first table in docs/status.md."""
    lines = STATUS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| promise |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows, end = [], start + 2
    while end < len(lines) and lines[end].startswith("|"):
        rows.append(dict(zip(header, (c.strip() for c in lines[end].strip("|").split("|")))))
        end += 1
    return end, rows


def gpu_cells() -> list[str]:
    return [row["GPU"] for row in table()[1]]


def linked(cell: str) -> list[tuple[Path, str]]:
    """(file, anchor) of each link in a cell, relative to docs/; docs/status.md itself for ``#anchor``."""
    out = []
    for target in LINK.findall(cell):
        file, _, anchor = target.partition("#")
        out.append(((STATUS.parent / file).resolve() if file else STATUS, anchor))
    return out


def test_the_table_covers_each_promise_and_readmes_first_screen_links_it():
    _, rows = table()
    assert "](docs/status.md)" in "\n".join(README.read_text().splitlines()[:FIRST_SCREEN])
    promises = " ".join(row["promise"] for row in rows).lower()
    for promise in ("4-bit base", "llama.cpp", "memory plans", "captured decode", "bf16 end to end", "data parallel",
                    "export", "app", "demo"):
        assert promise in promises, promise
    assert all(row["GPU"] and row["promise"] for row in rows)


def test_every_preset_appears_in_the_table():
    from homerlhf.config import preset_names

    text = " ".join(" ".join(row.values()) for row in table()[1])
    assert [name for name in preset_names() if f"`{name}`" not in text] == []


def test_every_link_resolves_to_a_file_and_heading():
    broken = []
    for row in table()[1]:
        for cell in row.values():
            for path, anchor in linked(cell):
                if not path.is_file() or (anchor and anchor not in sections(path)):
                    broken.append(f"{path.relative_to(ROOT)}#{anchor}")
    assert broken == []


def test_each_gpu_run_cell_is_dated_by_its_linked_doc():
    """A cell that names a GPU run (a date) links a doc holding that date and that card."""
    dated = [cell for cell in gpu_cells() if DATE.search(cell)]
    assert dated  # the H200 run
    for cell in dated:
        card = re.search(r"NVIDIA (?:GeForce )?([\w-]+(?: [\w-]*\d[\w-]*)?)", cell).group(1)
        docs = [sections(path).get(anchor, "") if anchor else path.read_text() for path, anchor in linked(cell)]
        for date in DATE.findall(cell):
            assert any(date in doc and card in doc for doc in docs), (date, card, cell)


def test_each_not_yet_run_cell_links_a_section_that_says_so():
    cells = [cell for cell in gpu_cells() if NOT_RUN.search(cell) and not DATE.search(cell)]
    assert len(cells) >= 5
    for cell in cells:
        docs = [sections(path).get(anchor, "") if anchor else path.read_text() for path, anchor in linked(cell)]
        assert any(SAYS_NOT_RUN.search(doc) for doc in docs), cell


def test_every_gpu_measurement_in_the_docs_has_its_cell():
    """Each (card, date) a doc says was measured on an NVIDIA GPU is a dated GPU cell of the table: a new
    GPU run written into docs/ fails this until docs/status.md says so."""
    measured = {(card, date) for doc in sorted((ROOT / "docs").glob("*.md"))
                for card, date in GPU_MEASURED.findall(doc.read_text())}
    assert ("H200", "2026-11-30") in measured
    cells = gpu_cells()
    assert [m for m in sorted(measured) if not any(m[0] in c and m[1] in c for c in cells)] == []


def test_the_checks_above_can_fail():
    """A made-up anchor, an undated claim and an unknown card are each caught by the pieces above."""
    assert "no-such-heading" not in sections(ROOT / "docs" / "memory.md")
    assert slug("The compute dtype end to end (`quant.upcast_non_quantized`)") == \
        "the-compute-dtype-end-to-end-quantupcast_non_quantized"
    found = GPU_MEASURED.findall("**Measured** on an NVIDIA GeForce RTX 4090 (CUDA 13; 2026-12-24), as ...")
    assert found == [("RTX 4090", "2026-12-24")] and not any("2026-12-24" in c for c in gpu_cells())
    assert not SAYS_NOT_RUN.search(sections(ROOT / "docs" / "time.md")["defaults-when-nothing-is-measured"].split(
        "**Other cards")[0])
