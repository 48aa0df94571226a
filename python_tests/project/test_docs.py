"""The docs a newcomer reads stay whole: README.md short enough to finish, every relative link in
README.md, ARCHITECTURE.md and docs/*.md pointing at a file that exists (and at a heading of it, by
GitHub's anchor rules), and every `python -m nanochat_fast...` command they name a real module."""

import re
from pathlib import Path

from support.repo_paths import ROOT

README_MAX_LINES = 300
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MODULE_COMMAND = re.compile(r"-m (nanochat_fast(?:\.\w+)+)")


def pages(root: Path) -> list[Path]:
    return [root / "README.md", root / "ARCHITECTURE.md", *sorted((root / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans: what GitHub renders as links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation dropped (hyphens and
    underscores kept), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(root: Path) -> list[str]:
    """'page: target (why)' for each relative link of the pages that does not resolve."""
    broken = []
    for page in pages(root):
        for target in LINK.findall(prose(page.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}: {target}"
            if not file.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{where} (no heading with that anchor)")
    return broken


def missing_modules(root: Path) -> list[str]:
    """'page: module' for each `-m nanochat_fast.X` a page names that is no module of the package
    (a placeholder in capitals, `scripts.NAME`, is not a name)."""
    missing = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for module in sorted(set(MODULE_COMMAND.findall(page.read_text()))):
            if module.rsplit(".", 1)[1].isupper():
                continue
            path = root / module.replace(".", "/")
            if not (path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()):
                missing.append(f"{page.relative_to(root)}: {module}")
    return missing


def test_readme_is_short_enough_to_finish():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move more to docs/"


def test_every_relative_link_resolves():
    assert not broken_links(ROOT), "broken links:\n" + "\n".join(broken_links(ROOT))


def test_every_command_names_a_real_module():
    assert not missing_modules(ROOT), f"commands naming no module: {missing_modules(ROOT)}"
    named = set(MODULE_COMMAND.findall((ROOT / "README.md").read_text()))
    assert {"nanochat_fast.scripts.base_train", "nanochat_fast.kernels"} <= named  # the check sees them


def test_slugs_follow_githubs_rules():
    assert slug("Train on ClimbMix / FineWeb-Edu") == "train-on-climbmix--fineweb-edu"
    assert slug("nanochat's model today: `--arch=windowed`") == "nanochats-model-today---archwindowed"
    assert slug("A one-row decode step: dispatch, not bytes") == "a-one-row-decode-step-dispatch-not-bytes"
    assert slug("Reinforcement learning: chat_rl") == "reinforcement-learning-chat_rl"
    assert slug("See [the guide](docs/guide.md) **now**") == "see-the-guide-now"


def test_the_checkers_find_what_is_broken(tmp_path):
    """A made-up tree with one good link of each kind and one broken one of each kind."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "ARCHITECTURE.md").write_text("# Architecture\n\n## Layers\n\n## Layers\n")
    (tmp_path / "docs" / "guide.md").write_text(
        "# Guide\n\n```\n# not a heading\n```\n\n## Runs that survive\n\n"
        "Back to the [top](#guide), [layers](../ARCHITECTURE.md#layers-1), not [code](#not-a-heading).\n"
    )
    (tmp_path / "README.md").write_text(
        "# x\n\n[guide](docs/guide.md#runs-that-survive), [site](https://example.com/a.md), "
        "![pic](docs/missing.png), [gone](docs/gone.md), [typo](docs/guide.md#runs-that-survived), "
        "`[in code](nowhere.md)`\n\n```\n[in a block](nowhere.md)\n```\n\n"
        "    python -m nanochat_fast.scripts.NAME; python -m nanochat_fast.scripts.base_trian\n"
    )
    assert broken_links(tmp_path) == [
        "README.md: docs/missing.png (no such file)",
        "README.md: docs/gone.md (no such file)",
        "README.md: docs/guide.md#runs-that-survived (no heading with that anchor)",
        "docs/guide.md: #not-a-heading (no heading with that anchor)",
    ]
    assert missing_modules(tmp_path) == ["README.md: nanochat_fast.scripts.base_trian"]
