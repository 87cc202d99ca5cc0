#!/usr/bin/env python3
"""Checks that the README's example is, character for character, examples/quickstart.cpp, and that
its fault-tolerant loop is the part of examples/elastic_loop.cpp between "// README begin" and
"// README end" (less its two spaces of indentation); the build compiles both with -Werror and
the tests run them, so the README never shows code that does not compile. And that the README's
Layout names every header under include/ddp and every file under tools/ (but CMakeLists.txt)."""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
readme = (root / "README.md").read_text()
m = re.search(r"<!-- the block below is examples/quickstart.cpp[^>]*-->\n```cpp\n(.*?)```", readme, re.S)
if not m:
    sys.exit("README.md: the marked example block was not found")
example = (root / "examples/quickstart.cpp").read_text()
if m.group(1) != example:
    sys.exit("README.md's example differs from examples/quickstart.cpp: update one from the other")
loop = re.search(r"<!-- the block below is the loop of examples/elastic_loop.cpp[^>]*-->\n```cpp\n(.*?)```",
                 readme, re.S)
src = re.search(r"  // README begin\n(.*?)  // README end\n",
                (root / "examples/elastic_loop.cpp").read_text(), re.S)
if not loop or not src:
    sys.exit("README.md or examples/elastic_loop.cpp: the marked loop was not found")
lines = [l[2:] if l.startswith("  ") else l for l in src.group(1).splitlines()]
if loop.group(1) != "".join(l + "\n" for l in lines):
    sys.exit("README.md's fault-tolerant loop differs from examples/elastic_loop.cpp: update one "
             "from the other")
layout = re.search(r"^## Layout\n.*?```\n(.*?)```", readme, re.S | re.M)
if not layout:
    sys.exit("README.md: the Layout section's block was not found")
unnamed = [str(f.relative_to(root)) for folder in ("include/ddp", "tools")
           for f in sorted((root / folder).rglob("*"))
           if f.is_file() and f.name != "CMakeLists.txt"
           and not re.search(r"(?<![\w.])" + re.escape(f.name) + r"(?![\w])", layout.group(1))]
if unnamed:
    sys.exit("README.md's Layout does not name: " + ", ".join(unnamed))
print("README example == examples/quickstart.cpp, README loop == examples/elastic_loop.cpp, "
      "README Layout names every header and tool")
