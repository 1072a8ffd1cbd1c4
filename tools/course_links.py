"""The README's Binder and Colab links, made from the one repository URL in pyproject.toml.

pyproject.toml's ``[project.urls] Repository`` names the GitHub repository. From it this script
writes
- the badge block between ``<!-- course-links:start -->`` and ``<!-- course-links:end -->``:
  Binder (JupyterLab opened at the quickstart) and "Open in Colab" for the quickstart;
- every Colab link elsewhere in the README (one per lesson in the course map): the notebook
  path in each link is kept, the repository and branch are rewritten.

Usage:
    python tools/course_links.py            # rewrite README.md in place
    python tools/course_links.py --check    # exit 1 if README.md is not what this would write,
                                            # or a lesson has no Colab link
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BRANCH = "main"
QUICKSTART = "notebooks/00_quickstart.ipynb"
START, END = "<!-- course-links:start -->", "<!-- course-links:end -->"
BINDER_BADGE = "https://mybinder.org/badge_logo.svg"
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
COLAB_LINK_RE = re.compile(r"https://colab\.research\.google\.com/github/[^)\s]*?/"
                           r"(notebooks/[\w./-]+\.ipynb)")
BINDER_LINK_RE = re.compile(r"https://mybinder\.org/v2/gh/[^)\s]+")


def repo_url(root: Path = ROOT) -> str:
    """``[project.urls] Repository`` from pyproject.toml (without a trailing slash or .git)."""
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: read the one line this needs
        section = re.search(r"^\[project\.urls\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        found = section and re.search(r'^Repository\s*=\s*"([^"]+)"', section.group(1), re.M)
        url = found.group(1) if found else None
    else:
        url = tomllib.loads(text).get("project", {}).get("urls", {}).get("Repository")
    if not url:
        raise ValueError("pyproject.toml has no [project.urls] Repository")
    url = url.rstrip("/").removesuffix(".git")
    if not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url):
        raise ValueError(f"[project.urls] Repository must be https://github.com/OWNER/NAME, got {url!r}")
    return url


def slug(url: str) -> str:
    """``owner/name`` of a GitHub URL."""
    return url.removeprefix("https://github.com/")


def colab_url(url: str, notebook: str) -> str:
    return f"https://colab.research.google.com/github/{slug(url)}/blob/{BRANCH}/{notebook}"


def binder_url(url: str, notebook: str = QUICKSTART) -> str:
    return f"https://mybinder.org/v2/gh/{slug(url)}/{BRANCH}?urlpath=lab/tree/{notebook}"


def colab_badge(url: str, notebook: str) -> str:
    return f"[![Open in Colab]({COLAB_BADGE})]({colab_url(url, notebook)})"


def badge_block(url: str) -> str:
    return (f"{START}\n"
            f"[![Binder]({BINDER_BADGE})]({binder_url(url)}) "
            f"{colab_badge(url, QUICKSTART)}\n"
            f"{END}")


def rewrite(readme: str, url: str) -> str:
    """`readme` with its badge block and every Colab/Binder link made from `url`."""
    if readme.count(START) != 1 or readme.count(END) != 1:
        raise ValueError(f"README needs exactly one {START} … {END} block")
    head, rest = readme.split(START)
    _, tail = rest.split(END)

    def links(part: str) -> str:
        part = COLAB_LINK_RE.sub(lambda m: colab_url(url, m.group(1)), part)
        return BINDER_LINK_RE.sub(binder_url(url), part)

    return links(head) + badge_block(url) + links(tail)


def problems(readme: str, root: Path = ROOT) -> list[str]:
    """What is wrong with `readme`'s links, as sentences (empty: up to date)."""
    url = repo_url(root)
    found = []
    try:
        wanted = rewrite(readme, url)
    except ValueError as e:
        return [str(e)]
    if wanted != readme:
        found.append(f"README.md's Binder/Colab links are not made from {url}: "
                     "run python tools/course_links.py")
    linked = set(COLAB_LINK_RE.findall(readme))
    for nb in sorted(root.glob("notebooks/[0-9][0-9]_*.ipynb")):
        path = nb.relative_to(root).as_posix()
        if path not in linked:
            found.append(f"README.md has no Colab link for {path}")
    for path in sorted(linked):
        if not (root / path).is_file():
            found.append(f"README.md links {path} in Colab, which does not exist")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if out of date")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = parser.parse_args(argv)
    text = args.readme.read_text(encoding="utf-8")
    if args.check:
        found = problems(text)
        print("\n".join(found) or "README.md's course links are up to date")
        return 1 if found else 0
    new = rewrite(text, repo_url())
    if new != text:
        args.readme.write_text(new, encoding="utf-8")
        print(f"rewrote the course links in {args.readme}")
    else:
        print(f"{args.readme}: course links already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
