"""Check the documentation: relative links resolve, and (with ``--old REV``) no figure of an older README was lost.

    python scripts/check_docs.py                 # links of README.md and docs/**/*.md
    python scripts/check_docs.py --old fb886ec   # also: every number of fb886ec's README.md is still there

Links: every ``[text](target)`` and ``![alt](target)`` outside code blocks whose target is not a URL must name a
file or folder that exists (relative to the page), and a ``#anchor`` must be a heading of the target page, with
GitHub's rule for heading anchors (lower case; punctuation other than ``-`` and ``_`` dropped; spaces to ``-``;
a repeated heading gets ``-1``, ``-2``, ...).

Figures (``--old``): every number token (``\\d+`` with ``.`` or ``,`` groups: ``1,276.8``, ``2.13.0``) must occur
at least as often in README.md and docs/**/*.md together as in the old README, and every table row of the old
README must occur verbatim (link targets aside: a moved page links elsewhere). Sentences of the old README not
found verbatim (whitespace normalised) are listed for reading, since a moved page may reword a cross-reference;
they do not fail the check.

Exit status 1 when a link is broken or a figure or table row is missing, else 0.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(text: str) -> str:
    """``text`` with fenced code blocks blanked (links inside them are code, not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file."""
    seen: Counter[str] = Counter()
    out = set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return out


def broken_links() -> list[str]:
    """One line per link that does not resolve: 'page: target (why)'."""
    bad = []
    for page in pages():
        for target in LINK.findall(prose(page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            name = page.relative_to(ROOT)
            if not dest.exists():
                bad.append(f"{name}: {target} (no such file)")
            elif anchor and (dest.is_dir() or dest.suffix != ".md" or anchor not in anchors(dest)):
                bad.append(f"{name}: {target} (no heading with that anchor)")
    return bad


def unlinked(text: str) -> str:
    """``text`` with every link target dropped: ``[text](target)`` -> ``[text]``."""
    return re.sub(r"(\])\([^)\s]+\)", r"\1", text)


def lost_figures(old: str, new: str) -> tuple[list[str], list[str], list[str]]:
    """(numbers missing, with counts; table rows missing; sentences not found verbatim) of ``old`` in ``new``."""
    have, want = Counter(NUMBER.findall(new)), Counter(NUMBER.findall(old))
    numbers = [f"{n} ({want[n]} in the old README, {have[n]} now)" for n in want if have[n] < want[n]]
    old, new = unlinked(old), unlinked(new)  # a moved page's links name other targets
    rows = [r for r in old.splitlines() if r.startswith("|") and r not in new]
    flat = " ".join(new.split())
    text = "\n".join(line for line in prose(old).splitlines() if not line.startswith("#"))  # headings were regrouped
    sentences = [s for s in re.split(r"(?<=[.:;])\s+", " ".join(text.split())) if s and s not in flat]
    return numbers, rows, sentences


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="a git revision whose README.md's figures must all still be in the docs")
    args = ap.parse_args(argv)
    failed = False
    for line in broken_links():
        print(f"broken link: {line}")
        failed = True
    if args.old:
        old = subprocess.run(["git", "show", f"{args.old}:README.md"], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout
        new = "\n".join(p.read_text() for p in pages())
        numbers, rows, sentences = lost_figures(old, new)
        for n in numbers:
            print(f"missing number: {n}")
        for r in rows:
            print(f"missing table row: {r}")
        for s in sentences:
            print(f"reworded (read it): {s}")
        failed = failed or bool(numbers or rows)
        print(f"{sum(Counter(NUMBER.findall(old)).values())} number tokens and "
              f"{sum(r.startswith('|') for r in old.splitlines())} table rows checked; {len(numbers)} numbers and "
              f"{len(rows)} rows missing; {len(sentences)} sentences reworded")
    print("ok" if not failed else "FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
