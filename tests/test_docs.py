"""The documents point at what exists: every relative link of README.md and docs/*.md, and every
`docs/<page>.md` that code, tests, tools and configs cite, is a file of this checkout; README.md
stays a user document (at most 320 lines, the commands first) that states CI's two test lines."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](target) or [text](target#anchor)
CITED_PAGE = re.compile(r"\bdocs/[\w.-]+\.md\b")


def relative_links(document: Path) -> list[str]:
    return [t for t in LINK.findall(document.read_text()) if "://" not in t]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(document):
    missing = [t for t in relative_links(document) if not (document.parent / t).exists()]
    assert not missing, f"{document.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_every_cited_docs_page_exists():
    sources = [p for folder in ("src", "tests", "tools", "configs", "docs") for p in (ROOT / folder).rglob("*")
               if p.suffix in {".py", ".yaml", ".md", ".sh"}]
    sources += [ROOT / "Makefile", ROOT / "setup.py", ROOT / "README.md", ROOT / ".ci" / "run"]
    missing = sorted({f"{p.relative_to(ROOT)}: {page}" for p in sources for page in CITED_PAGE.findall(p.read_text())
                      if not (ROOT / page).exists()})
    assert not missing, "cited pages that do not exist:\n" + "\n".join(missing)


def test_the_readme_is_short_starts_with_commands_and_states_cis_test_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 320
    first_command = next(i for i, line in enumerate(lines) if line.startswith("make "))
    assert first_command < 40
    ci = (ROOT / ".ci" / "run").read_text()
    for target in ("make test", "make test-py312"):  # .ci/run runs "the README's two test lines"
        assert any(line.startswith(target + " ") or line == target for line in lines), target
        assert f"{target} " in ci
