"""The README and docs/: the CLI reference matches the parsers, every relative link resolves, the
README stays a short front door, and the text points at nothing outside the repository."""

from __future__ import annotations

import re
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from testkit import REPO_ROOT, load_script

gen_cli_reference = load_script("gen_cli_reference")

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def test_cli_reference_matches_the_parsers(monkeypatch):
    monkeypatch.setenv("ENCODER_PORT", "1234")  # the page shows declared defaults, not this shell's
    committed = gen_cli_reference.PAGE.read_text()
    assert committed == gen_cli_reference.render(), (
        "docs/cli-reference.md is out of date: run python scripts/gen_cli_reference.py"
    )


def test_cli_reference_lists_every_console_script():
    page = gen_cli_reference.PAGE.read_text()
    for command in gen_cli_reference.console_scripts():
        assert f"## `{command}`" in page, command


def test_cli_reference_check_mode_fails_on_a_stale_page(tmp_path):
    stale = tmp_path / "cli-reference.md"
    stale.write_text(gen_cli_reference.PAGE.read_text().replace("--port", "--prot"))
    assert gen_cli_reference.main(["--check", "--out", str(stale)]) == 1
    assert gen_cli_reference.main(["--out", str(stale)]) == 0  # rewrites it
    assert gen_cli_reference.main(["--check", "--out", str(stale)]) == 0
    assert stale.read_text() == gen_cli_reference.PAGE.read_text()


def test_readme_is_a_short_front_door():
    size = len((REPO_ROOT / "README.md").read_bytes())
    assert size < 16 * 1024, f"README.md is {size} bytes: move topics to docs/"


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        base, n = slug, 1
        while slug in found:
            slug, n = f"{base}-{n}", n + 1
        found.add(slug)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(page):
    text = FENCE.sub("", page.read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / urllib.parse.unquote(path)).resolve() if path else page
        if not resolved.exists() or REPO_ROOT not in [resolved, *resolved.parents]:
            broken.append(target)
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO_ROOT)}: links that do not resolve: {broken}"


def test_docs_cover_the_topics():
    names = {p.name for p in PAGES}
    for topic in ["architecture.md", "wire-protocol.md", "prefill-side.md", "performance.md",
                  "reliability-security.md", "deployment.md", "cli-reference.md"]:
        assert topic in names, topic
    readme = (REPO_ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, f"README.md does not point to docs/{page.name}"
    assert "```mermaid" in (REPO_ROOT / "docs" / "architecture.md").read_text()


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    files = [REPO_ROOT / name for name in listed.stdout.decode().split("\0") if name]
    return [f for f in files if f.is_file() and b"\0" not in f.read_bytes()[:8192]]


def test_no_reference_to_files_outside_the_repository():
    outside = ["FACTS" + ".md", ".." + "/shared", "/work" + "/shared"]
    hits = [
        f"{path.relative_to(REPO_ROOT)}: {word}"
        for path in tracked_text_files()
        for word in outside
        if word in path.read_text(errors="replace")
    ]
    assert not hits, hits


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_docs_say_what_is_true_not_how_the_work_went(page):
    text = page.read_text().lower()
    history = ["before this change", "earlier today", "earlier runs", "this session", "not run here",
               "no gpu was lent", "no gpu in this task", "merge note", "not done here"]
    assert not [phrase for phrase in history if phrase in text]


def test_the_docs_anchors_named_in_the_code_exist():
    """A comment or message pointing at `docs/<page>.md#<heading>` points at a heading that is there."""
    named = re.compile(r"docs/([\w-]+\.md)#([\w-]+)")
    broken = [
        f"{path.relative_to(REPO_ROOT)}: docs/{page}#{anchor}"
        for path in tracked_text_files()
        if path.suffix in {".py", ".sh", ".yaml", ".toml", ".proto"}
        for page, anchor in named.findall(path.read_text(errors="replace"))
        if not (REPO_ROOT / "docs" / page).exists() or anchor not in anchors(REPO_ROOT / "docs" / page)
    ]
    assert not broken, broken
