"""The user guide builds: `mkdocs build --strict` over `mkdocs.yml` and `docs/` succeeds, so a
link to a page or an anchor that is not there, or a page left out of the navigation, fails the
tests. The same configuration, given a page with a broken link, an unknown anchor or a page
outside the navigation, fails the build (the check can fail). Also: every link the README makes
leads to a file, and every flag the command-line page names is a flag of `nanoserve`."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# Material for MkDocs prints a banner about its end of life on every build unless told not to
_QUIET = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of `config` into `site`."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
         "--site-dir", str(site)],
        capture_output=True, text=True, timeout=120, env=_QUIET)


def test_the_guide_builds_strictly(tmp_path: Path) -> None:
    result = mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    for page in _nav_pages(config["nav"]):
        built = tmp_path / "site" / (page.removesuffix(".md") + "/index.html")
        if page == "index.md":
            built = tmp_path / "site" / "index.html"
        assert built.exists(), page


def _nav_pages(nav: list[object]) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [str(value)]
    return pages


# a page with each fault, under the guide's own configuration (theme, validation, strict)
_FAULTS = {
    "a link to a missing page": ("[gone](missing.md)", "missing.md"),
    "a link to a missing anchor": ("[gone](other.md#no-such-section)", "no-such-section"),
    "a page left out of the nav": ("fine", "orphan.md"),
}


@pytest.mark.parametrize("fault", list(_FAULTS))
def test_the_strict_build_fails_on(fault: str, tmp_path: Path) -> None:
    text, named = _FAULTS[fault]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# Home\n\n{text}\n")
    (docs / "other.md").write_text("# Other\n\n## A section\n")
    (docs / "orphan.md").write_text("# Orphan\n")
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    config.update(docs_dir=str(docs), nav=[{"Home": "index.md"}, {"Other": "other.md"}])
    if fault != "a page left out of the nav":
        config["nav"].append({"Orphan": "orphan.md"})
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0, result.stdout + result.stderr
    assert named in result.stdout + result.stderr


def test_every_link_in_the_readme_leads_to_a_file() -> None:
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link.split("#")[0] for link in links if "://" not in link]
    assert local, "the README links into the guide"
    assert [link for link in local if not (REPO / link).is_file()] == []


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag of `parser` and of its subcommands, recursively."""
    flags: set[str] = set()
    for action in parser._actions:
        flags.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _option_strings(sub)
    return flags


# flags of the peers the page names beside ours (llama-server's)
_PEER_FLAGS = {"--no-repack"}


def test_every_flag_the_command_line_page_names_exists() -> None:
    from nanoserve.entrypoints.cli import build_parser

    page = (REPO / "docs" / "cli.md").read_text()
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", page)) - _PEER_FLAGS
    assert len(named) > 50, "the page lists the server's flags"
    assert sorted(named - _option_strings(build_parser())) == []
