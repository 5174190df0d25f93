"""The documentation (docs/, built by mkdocs.yml) against the code it describes.

1. The generated pages (docs/cli/*.md, docs/config.md) equal what ``python docs/gen_cli.py``
   writes now: a changed option or config field without regenerating them fails here. Every
   page is in the site's navigation.
2. The code cites the concepts page by anchor (``docs/concepts.md#zero``): every cited anchor
   is a heading of docs/concepts.md, and nothing cites a file the repository does not have
   (the notes the code once cited lived outside it).
3. Every ``tiertrain`` command shown in a shell block of a hand-written page exists, and so does
   each of its options: the command's own (its ``--help``) or a config field (``--zero.stage``).

The site itself is built by CI (``mkdocs build --strict``, .ci/run), which fails on a broken
link or anchor between pages.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONCEPTS = DOCS / "concepts.md"
REGENERATE = "run `python docs/gen_cli.py` and commit the pages it writes"


# -- 1. generated pages ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs")
    done = subprocess.run([sys.executable, str(DOCS / "gen_cli.py"), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"docs/gen_cli.py failed:\n{done.stdout}\n{done.stderr}"
    return out


def _pages(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*.md")}


def test_generated_pages_are_current(generated):
    expected = _pages(generated)
    assert {"cli/index.md", "cli/train.md", "config.md"} <= expected
    committed_cli = {p for p in _pages(DOCS) if p.startswith("cli/")}
    stale = sorted(committed_cli - expected)
    assert not stale, f"docs/{stale} document no command of `tiertrain --help`: {REGENERATE}"
    for rel in sorted(expected):
        page = DOCS / rel
        assert page.exists(), f"docs/{rel} is missing: {REGENERATE}"
        assert page.read_text() == (generated / rel).read_text(), f"docs/{rel} is out of date: {REGENERATE}"


def test_every_page_is_in_the_navigation(generated):
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def entries(nav) -> set[str]:
        found = set()
        for item in nav:
            for value in (item.values() if isinstance(item, dict) else [item]):
                found |= entries(value) if isinstance(value, list) else {value}
        return found

    nav = entries(config["nav"])
    missing = sorted((_pages(generated) | {"index.md", "tutorial.md", "concepts.md", "migrate-deepspeed.md",
                                           "migrate-fsdp2.md", "api.md", "changelog.md"}) - nav)
    assert not missing, f"mkdocs.yml's nav lacks {missing}"


# -- 2. citations of the concepts page ------------------------------------------------------------

def slugify(text: str) -> str:
    """A heading's anchor as mkdocs (Python-Markdown's toc extension) makes it."""
    text = re.sub(r"<[^>]+>|`", "", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(markdown: str) -> set[str]:
    found: dict[str, int] = {}
    out = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*(?:\{#([\w-]+)\})?\s*$", line)
        if in_code or not m:
            continue
        slug = m.group(2) or slugify(m.group(1))
        if slug in found:  # (toc numbers repeated headings: slug_1, slug_2, ...)
            found[slug] += 1
            slug = f"{slug}_{found[slug]}"
        else:
            found[slug] = 0
        out.add(slug)
    return out


def _sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    for folder in ("tiertrain", "tests", "bench", "docs", "examples"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md") and p.is_file()]
    return files


def test_concepts_citations_name_existing_sections():
    assert CONCEPTS.exists(), "docs/concepts.md is missing (the code cites it)"
    known = anchors(CONCEPTS.read_text())
    assert {"zero", "zero-offload", "zero-infinity", "megatron-ptd-p"} <= known
    cited, broken = 0, []
    for path in _sources():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for anchor in re.findall(r"docs/concepts\.md#([\w-]+)", line) + re.findall(r"\(concepts\.md#([\w-]+)\)", line):
                cited += 1
                if anchor not in known:
                    broken.append(f"{path.relative_to(ROOT)}:{n}: #{anchor}")
    assert cited >= 10, "the code's citations of docs/concepts.md are gone"
    assert not broken, f"cited sections that docs/concepts.md does not have: {broken}"


CITATION = re.compile(r"\b(ZeRO-Offload|ZeRO-Infinity|ZeRO|Megatron)(?: PTD-P| PTD-P's|-LM)? §(\d+(?:\.\d+)*)")


def test_every_section_number_the_code_cites_is_explained():
    """A citation such as "ZeRO §5.2" in a docstring is one the concepts page's table of
    section numbers lists, with the part of the page that explains it."""
    text = CONCEPTS.read_text()
    table = text[text.index("## Section numbers cited in the code"):]
    listed = {f"{paper} §{number}" for paper, number in re.findall(r"^\| (\S+) §([\d.]+) \|", table, re.M)}
    assert len(listed) >= 15, "the table of cited section numbers is gone from docs/concepts.md"
    cited, unknown = set(), []
    for path in _sources():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for paper, number in CITATION.findall(line):
                cited.add(f"{paper} §{number}")
                if f"{paper} §{number}" not in listed:
                    unknown.append(f"{path.relative_to(ROOT)}:{n}: {paper} §{number}")
    assert not unknown, f"section numbers cited but not in docs/concepts.md's table: {unknown}"
    assert len(cited) >= 15


def test_nothing_cites_the_notes_outside_the_repository():
    outside = "PAPERS" + ".md"
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in _sources()
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside in line]
    assert not hits, f"{outside} is not in the repository; cite docs/concepts.md#<section> instead: {hits}"


# -- 3. the commands the pages show ---------------------------------------------------------------

def _shell_lines(markdown: str) -> list[str]:
    """The lines of the ```bash blocks, continuation lines joined."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", markdown, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    return lines


def test_commands_shown_in_the_docs_exist():
    commands = {p.stem for p in (DOCS / "cli").glob("*.md")} - {"index"}
    config_fields = set(re.findall(r"^\| `([\w.]+)` \|", (DOCS / "config.md").read_text(), re.M))
    assert "zero.stage" in config_fields and "steps" in config_fields
    hand_written = [p for p in DOCS.rglob("*.md") if not p.relative_to(DOCS).parts[0] in ("cli",)
                    and p.name not in ("config.md", "changelog.md")]
    shown, wrong = 0, []
    for page in hand_written:
        for line in _shell_lines(page.read_text()):
            words = shlex.split(line, comments=True)
            if len(words) < 2 or words[0] != "tiertrain":
                continue
            shown += 1
            command = words[1]
            if command not in commands:
                wrong.append(f"{page.name}: `tiertrain {command}` is not a command")
                continue
            help_text = (DOCS / "cli" / f"{command}.md").read_text()
            for word in words[2:]:
                if not word.startswith("--"):
                    continue
                option = word[2:].split("=", 1)[0]
                if re.search(rf"(?<![\w-])--{re.escape(option)}(?![\w-])", help_text):
                    continue
                if command in ("train", "config") and option in config_fields:
                    continue
                wrong.append(f"{page.name}: `tiertrain {command}` has no option --{option}")
    assert shown >= 10, "no tiertrain commands found in the docs' shell blocks"
    assert not wrong, wrong
