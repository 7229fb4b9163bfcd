"""The docs as a newcomer reads them: each page opens with what it answers and stays short, and so does the
whole set; no table cell runs on; no run log in the prose (times, dates, commit hashes); one list of
families; and every measured table and plot comes from the result files: the generator, run on a copy of
the repository, reproduces the committed tables and draws every plot a page shows."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from encoder_common.families import FAMILIES
from testkit import REPO_ROOT, load_script

render_results = load_script("render_results")

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
MAX_PAGE_WORDS = 2500
MAX_TOTAL_WORDS = 20000  # README.md and every page of docs/, the generated ones and result tables included
# Made from the command parsers by scripts/gen_cli_reference.py: a table to look a flag up in, exempt from the
# per-page limit but counted in the set's total.
GENERATED_PAGES = {"cli-reference.md"}
MAX_CELL_CHARS = 300
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
RESULT_BLOCK = re.compile(r"<!-- results:([\w-]+) -->.*?<!-- /results:\1 -->", re.DOTALL)
RUN_LOG = {
    "a time of day": re.compile(r"\b\d{1,2}:\d{2}(:\d{2})?\s*(-\s*\d{1,2}:\d{2}\s*)?UTC\b"),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a commit hash": re.compile(r"`(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}`"),
}


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO_ROOT))


def prose(page: Path) -> str:
    """The page without its code blocks and without the tables drawn from result files."""
    return RESULT_BLOCK.sub("", FENCE.sub("", page.read_text()))


def words(page: Path) -> int:
    return len(page.read_text().split())


def table_cells(text: str) -> list[str]:
    cells = []
    for line in text.splitlines():
        if line.startswith("|"):
            cells += [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
    return cells


@pytest.mark.parametrize("page", [page for page in PAGES if page.name not in GENERATED_PAGES], ids=page_id)
def test_each_page_is_short(page):
    """A page of prose; the generated CLI reference is a table to look things up in, counted in the set."""
    assert words(page) <= MAX_PAGE_WORDS, (
        f"{page_id(page)}: {words(page)} words; a page holds {MAX_PAGE_WORDS}"
    )


def test_the_whole_set_is_short():
    """Every page counts, the generated CLI reference too: a flag added grows the set a reader is handed."""
    total = sum(words(page) for page in PAGES)
    assert total <= MAX_TOTAL_WORDS, (
        f"README.md and docs/ hold {total} words; the set holds {MAX_TOTAL_WORDS}"
    )


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_each_page_opens_with_what_it_answers(page):
    """Under its title, a page begins with a paragraph of prose, not a table, a list, code or a heading."""
    text = FENCE.sub("```", page.read_text()).lstrip()
    assert text.startswith("# "), f"{page_id(page)} does not start with its title"
    opening = text.split("\n", 1)[1].lstrip("\n").split("\n\n", 1)[0]
    assert opening and not re.match(r"[#|`!<>\-*\d]", opening), (
        f"{page_id(page)} opens with: {opening[:80]!r}"
    )
    assert len(opening.split()) >= 12, f"{page_id(page)}: the opening says too little: {opening!r}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_table_cell_runs_on(page):
    longest = max(table_cells(FENCE.sub("", page.read_text())), key=len, default="")
    assert len(longest) <= MAX_CELL_CHARS, (
        f"{page_id(page)}: a cell of {len(longest)} characters: {longest[:120]}..."
    )


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_run_log_in_the_prose(page):
    """History belongs to git and measured figures to result files: the prose carries no times of day, dates
    or commit hashes (the captions of tables drawn from result files carry their dates)."""
    text = prose(page)
    found = {what: pattern.search(text).group(0) for what, pattern in RUN_LOG.items() if pattern.search(text)}
    assert not found, f"{page_id(page)}: {found}"


def test_the_readme_names_the_families_of_the_families_page():
    families_page = (REPO_ROOT / "docs" / "families.md").read_text()
    rows = re.findall(r"^\| ([^|`]+?) \(`(\w+)`\) \|", families_page, re.MULTILINE)
    assert {code for _, code in rows} == set(FAMILIES), (
        "docs/families.md's table differs from encoder_common/families.py"
    )
    readme = (REPO_ROOT / "README.md").read_text()
    missing = [name for name, _ in rows if name not in readme]
    assert not missing, f"README.md does not name {missing}, which docs/families.md lists"


def test_every_result_file_says_where_and_how_it_was_measured():
    files = sorted((REPO_ROOT / render_results.RESULTS).glob("*.json"))
    assert files, "benchmarks/results/ holds no result file"
    for path in files:
        document = json.loads(path.read_text())
        for key in ("benchmark", "date", "commit", "command", "machine", "load", "result"):
            assert document.get(key) not in (None, ""), f"{path.name} has no {key}"
        assert document["benchmark"] == path.stem and document["machine"]["cores"] > 0, path.name


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    """A copy of the pages and result files, with the tables and plots drawn afresh by the generator."""
    root = tmp_path_factory.mktemp("rendered")
    shutil.copy(REPO_ROOT / "README.md", root / "README.md")
    (root / "docs").mkdir()
    for page in (REPO_ROOT / "docs").glob("*.md"):
        shutil.copy(page, root / "docs" / page.name)
    shutil.copytree(REPO_ROOT / render_results.RESULTS, root / render_results.RESULTS)
    assert render_results.main(["--root", str(root)]) == 0
    return root


def test_the_committed_tables_are_what_the_result_files_give(rendered):
    stale = [
        page_id(page)
        for page in PAGES
        if (rendered / page.relative_to(REPO_ROOT)).read_text() != page.read_text()
    ]
    assert not stale, f"out of date: {stale}; run python scripts/render_results.py"
    assert render_results.main(["--check"]) == 0


def test_every_plot_a_page_shows_is_drawn_from_the_result_files(rendered):
    drawn = {path.name for path in (rendered / render_results.FIGURES).glob("*.svg")}
    committed = {path.name for path in (REPO_ROOT / render_results.FIGURES).glob("*.svg")}
    assert committed == drawn, f"docs/figures/ differs from what the generator draws: {committed ^ drawn}"
    for page in PAGES:
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text()):
            figure = (page.parent / target).resolve()
            assert figure.parent == (REPO_ROOT / render_results.FIGURES).resolve(), (
                f"{page_id(page)}: {target}"
            )
            # scripts/trace_picture.py draws one recorded trace, kept beside its picture as NAME.json.
            recorded_trace = figure.suffix == ".png" and figure.with_suffix(".json").exists()
            assert figure.name in drawn or recorded_trace, f"{page_id(page)} shows {target}, which no result file draws"


def test_a_missing_result_file_is_an_error_not_an_empty_table(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# x\n\n<!-- results:fuzz -->\n<!-- /results:fuzz -->\n")
    (tmp_path / render_results.RESULTS).mkdir(parents=True)
    with pytest.raises(render_results.MissingResult, match="fuzz"):
        render_results.main(["--root", str(tmp_path)])
