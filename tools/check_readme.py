#!/usr/bin/env python3
"""Checks the README and the guide against the sources: README.md is the front page (at most
MAX_README lines); its example is, character for character, examples/quickstart.cpp; the
fault-tolerant loop of docs/guide/fault_tolerance.md is the part of examples/elastic_loop.cpp
between "// README begin" and "// README end" (less its two spaces of indentation): the build
compiles both with -Werror and the tests run them. Every relative link of README.md, docs/ and
bench/README.md reaches a file that exists, and an #anchor a heading of that file. (The Layout page
is generated and checked by tools/layout.py.)"""
import pathlib
import re
import sys

MAX_README = 250
root = pathlib.Path(__file__).resolve().parent.parent
readme = (root / "README.md").read_text()
errors = []
lines = readme.count("\n")
if lines > MAX_README:
    errors.append(f"README.md has {lines} lines (at most {MAX_README}): move the detail to a "
                  "page of docs/guide/")
m = re.search(r"<!-- the block below is examples/quickstart.cpp[^>]*-->\n```cpp\n(.*?)```", readme, re.S)
if not m:
    errors.append("README.md: the marked example block was not found")
elif m.group(1) != (root / "examples/quickstart.cpp").read_text():
    errors.append("README.md's example differs from examples/quickstart.cpp: update one from the other")
guide = (root / "docs/guide/fault_tolerance.md").read_text()
loop = re.search(r"<!-- the block below is the loop of examples/elastic_loop.cpp[^>]*-->\n```cpp\n(.*?)```",
                 guide, re.S)
src = re.search(r"  // README begin\n(.*?)  // README end\n",
                (root / "examples/elastic_loop.cpp").read_text(), re.S)
if not loop or not src:
    errors.append("docs/guide/fault_tolerance.md or examples/elastic_loop.cpp: the marked loop was "
                  "not found")
else:
    lines = [l[2:] if l.startswith("  ") else l for l in src.group(1).splitlines()]
    if loop.group(1) != "".join(l + "\n" for l in lines):
        errors.append("docs/guide/fault_tolerance.md's fault-tolerant loop differs from "
                      "examples/elastic_loop.cpp: update one from the other")


def slug(heading):
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


pages = [root / "README.md", root / "bench/README.md", *sorted((root / "docs").rglob("*.md"))]
links = 0
for page in pages:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        links += 1
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = page.relative_to(root)
        if not dest.exists():
            errors.append(f"{where}: link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            errors.append(f"{where}: link to {target}: no heading #{anchor} there")
if errors:
    sys.exit("\n".join(errors))
print(f"README.md ({readme.count(chr(10))} lines) example == examples/quickstart.cpp, the guide's "
      f"loop == examples/elastic_loop.cpp, {links} links of {len(pages)} pages resolve")
