"""The docs hold together: every relative link and image in README.md, docs/*.md and the measurements
in benchmarks/results/*.md resolves (heading anchors included), every config key under conf/ is
documented in docs/configuration.md, and no page is longer than a reference page should be."""

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RESULTS = sorted((REPO / "benchmarks" / "results").glob("*.md"))  # dated measurements the pages link to
REFERENCE = REPO / "docs" / "configuration.md"
MAX_PAGE_LINES = 400
MAX_DOCS_WORDS = 48_805  # docs/ on 2026-12-06 (issue 74): a reference grows by replacing, not by adding
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SKIPPED_KEYS = {"defaults", "_target_"}


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code removed: what markdown renders as links
    and headings."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(lines: list[str]) -> list[tuple[int, int, str]]:
    """(line index, level, text) of every heading outside fenced code blocks."""
    found, fenced = [], False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#{1,6}) (.*)", line)):
            found.append((i, len(m.group(1)), m.group(2)))
    return found


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    found = set()
    for _, _, heading in headings(path.read_text().splitlines()):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links() -> Iterator[tuple[Path, str]]:
    for doc in [*DOCS, *RESULTS]:
        for line in prose(doc.read_text()):
            for target in LINK.findall(line):
                if not re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not checked here
                    yield doc, target


def test_docs_exist_and_link_to_each_other() -> None:
    names = {doc.name for doc in DOCS}
    assert {"README.md", "configuration.md", "sync.md"} <= names
    targets = {(doc.name, target) for doc, target in links()}
    for doc in DOCS[1:]:  # the README's map reaches every page of docs/
        assert ("README.md", f"docs/{doc.name}") in targets, f"README.md's map lacks docs/{doc.name}"


def test_every_page_is_a_reference_of_at_most_400_lines() -> None:
    """Measurements live in benchmarks/results/ (dated), linked from the page that explains them."""
    long = {doc.name: n for doc in DOCS if (n := len(doc.read_text().splitlines())) > MAX_PAGE_LINES}
    assert not long, f"pages over {MAX_PAGE_LINES} lines: {long}"
    linked = {(doc.parent / target.partition("#")[0]).resolve() for doc, target in links() if doc in DOCS}
    assert all(result.resolve() in linked for result in RESULTS), [r.name for r in RESULTS if r.resolve() not in linked]


def test_the_docs_stay_within_their_word_budget() -> None:
    words = sum(len(doc.read_text().split()) for doc in DOCS[1:])  # docs/*.md, as wc -w counts
    assert words <= MAX_DOCS_WORDS, f"docs/ holds {words} words, over its {MAX_DOCS_WORDS}: move measurements out"


@pytest.mark.parametrize("doc,target", sorted({(d.relative_to(REPO).as_posix(), t) for d, t in links()}))
def test_relative_link_resolves(doc: str, target: str) -> None:
    path, _, anchor = target.partition("#")
    dest = (REPO / doc).parent / path if path else REPO / doc
    assert dest.exists(), f"{doc}: link to {target}: {dest.relative_to(REPO)} does not exist"
    if anchor:
        assert dest.suffix == ".md", f"{doc}: link to {target}: an anchor into a file that is not markdown"
        assert anchor in anchors(dest), f"{doc}: link to {target}: no heading in {path or doc} has anchor #{anchor}"


def leaves(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key not in SKIPPED_KEYS:
                yield from leaves(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip(".")


def config_keys() -> list[tuple[str, str, str]]:
    """(file, group, key) for every leaf key of every option of every group; a `_global_` option's
    keys name their group first (`sync.collective`); the hydra group and hydra.* keys are Hydra's."""
    found = []
    for path in sorted((REPO / "conf").glob("*/*.yaml")):
        group = path.parent.name
        if group in {"hydra", "local"}:
            continue
        text = path.read_text()
        for key in leaves(yaml.safe_load(text) or {}):
            if "# @package _global_" in text:
                group, _, key = key.partition(".")
                if group == "hydra" or not key:
                    continue
            found.append((path.relative_to(REPO).as_posix(), group, key))
    for key in leaves(yaml.safe_load((REPO / "conf" / "config.yaml").read_text())):
        if not key.startswith("hydra."):
            found.append(("conf/config.yaml", "", key))
    return found


def sections(text: str) -> Iterator[tuple[str, str]]:
    """(heading, body up to the next heading of the same or a higher level), outside code blocks."""
    lines = text.splitlines()
    starts = headings(lines)
    for n, (i, level, heading) in enumerate(starts):
        end = next((j for j, lv, _ in starts[n + 1 :] if lv <= level), len(lines))
        yield heading, "\n".join(lines[i + 1 : end])


def mentions(text: str, name: str) -> bool:
    """`name` as a code span of its own, or opening one (`name: value`, `name=value`)."""
    return re.search(rf"`{re.escape(name)}(`|: |=)", text) is not None


def documented(reference: str, group: str, key: str) -> bool:
    """`group.key` anywhere in the reference, or `key` in a section whose heading names the group in
    backticks; a top-level key (group "") as `key` anywhere."""
    if not group:
        return mentions(reference, key)
    if mentions(reference, f"{group}.{key}"):
        return True
    return any(f"`{group}`" in heading and mentions(body, key) for heading, body in sections(reference))


def test_every_config_key_is_in_the_configuration_reference() -> None:
    reference = REFERENCE.read_text()
    keys = config_keys()
    groups = {group for _, group, _ in keys}
    # Not vacuous: every group of conf/ has keys here, and each has its own heading in the reference.
    assert {"model", "data", "sync", "optim", "schedule", "trainer", "logger"} <= groups
    assert len(keys) > 100, keys
    headings = [heading for heading, _ in sections(reference)]
    for group in groups - {""}:
        assert any(f"`{group}`" in heading for heading in headings), f"no heading for `{group}` in {REFERENCE.name}"
    missing = sorted({f"{file}: {group}.{key}" for file, group, key in keys if not documented(reference, group, key)})
    assert not missing, (
        f"config keys missing from docs/{REFERENCE.name} (write `group.key`, or `key` under the group's "
        "heading):\n" + "\n".join(missing)
    )


def test_the_memory_examples_are_what_the_tool_prints() -> None:
    """docs/memory.md's example sessions, each made again from its command by the tool that rewrites
    them (`python -m trainer.tools.doc_examples docs/memory.md`), in check mode: the docs show what
    the memory predictor prints today."""
    from trainer.tools import doc_examples

    assert doc_examples.main([str(REPO / "docs" / "memory.md"), "--check"]) == 0
