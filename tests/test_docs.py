"""The README and docs/ as reference: short lines, no dangling paths, citations that resolve.

Checks what a reader trips over first: a README line too long to read, a path or link to a file
that is not in the repository, a citation of a design file users do not have, and a
citation of a docs section that no longer exists.
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, ROOT / "xclbins" / "README.md"]
# Top-level entries whose paths the docs name in backticks.
TOP = ("runtime/", "docs/", "tests/", "benchmarks/", "examples/", "training/", "xclbins/", "litellm_flm/")
MAX_README_LINE = 200


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    suffixes = {".py", ".md", ".toml", ".yaml", ".yml", ".json", ".txt", ".cfg"}
    return [ROOT / f for f in out.splitlines() if Path(f).suffix in suffixes and (ROOT / f).is_file()]


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _referenced_paths(page: Path) -> set[str]:
    """Repository paths a page names: relative link targets and backticked paths under ``TOP``."""
    text = page.read_text()
    found = set()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:|#", target):
            found.add(str((page.parent / target.split("#")[0]).resolve().relative_to(ROOT)))
    for token in re.findall(r"`([^`\s]+)`", text):
        path = token.split(":")[0].rstrip(".,")
        if path.startswith(TOP) and not re.search(r"[*{<]|NNNN", path):
            found.add(path)
    return found


def test_readme_lines_outside_code_blocks_are_at_most_200_characters():
    long = [line for line in _prose((ROOT / "README.md").read_text()) if len(line) > MAX_README_LINE]
    assert long == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_is_in_the_repository(page):
    missing = sorted(p for p in _referenced_paths(page) if not (ROOT / p).exists())
    assert missing == []


def test_no_file_cites_a_design_file_outside_the_repository():
    cites = [str(f.relative_to(ROOT)) for f in _tracked_text_files()
             if re.search(r"DESIGN(\.md)? ?§", f.read_text(errors="replace"))]
    assert cites == []


def test_every_cited_docs_section_exists():
    headings = {page: [line.lstrip("#").strip() for line in _prose(page.read_text()) if line.startswith("#")]
                for page in DOCS}
    dangling = []
    for f in _tracked_text_files():
        for doc, section in re.findall(r"(docs/[\w/]+\.md),? \"([^\"]+)\"", f.read_text(errors="replace")):
            page, section = ROOT / doc, " ".join(section.replace("#", " ").split())  # wrapped in a comment
            if page not in headings or not any(h.startswith(section) for h in headings[page]):
                dangling.append(f"{f.relative_to(ROOT)}: {doc}, {section!r}")
    assert dangling == []


INCLUDED = re.compile(r"^<!-- the file (\S+), as it is -->\n```\w*\n(.*?)^```$", re.M | re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_page_shows_whole_is_shown_as_it_is(page):
    """A code block under ``<!-- the file PATH, as it is -->`` is that file, byte for byte (the
    deployment guide's configs are the ones its test runs)."""
    stale = [path for path, shown in INCLUDED.findall(page.read_text()) if (ROOT / path).read_text() != shown]
    assert stale == []


def test_the_readme_starts_the_example_proxy_as_the_configs_header_does():
    """The same key length and bind address in both places a user copies the commands from."""
    def flags(text: str) -> tuple[list[str], list[str]]:
        return re.findall(r"openssl rand -hex (\d+)", text), re.findall(r"--config \S+ --host (\S+)", text)

    readme = (ROOT / "README.md").read_text().split("### In a LiteLLM proxy", 1)[1].split("\n### ", 1)[0]
    assert flags(readme) == flags((ROOT / "examples" / "proxy_config.yaml").read_text()) == (["32"], ["127.0.0.1"])
