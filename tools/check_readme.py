#!/usr/bin/env python3
"""Checks that the README's example is, character for character, examples/quickstart.cpp
(which the build compiles with -Werror and the tests run), so the README never shows code that
does not compile."""
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
print("README example == examples/quickstart.cpp")
