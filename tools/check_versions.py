#!/usr/bin/env python3
"""Checks that every place that states ddp's version agrees with include/ddp/version.hpp."""
import json
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
text = (root / "include/ddp/version.hpp").read_text()
version = ".".join(re.search(rf"#define DDP_VERSION_{p} (\d+)", text).group(1)
                   for p in ("MAJOR", "MINOR", "PATCH"))
found = {
    "meson.build": re.search(r"version:\s*'([^']+)'", (root / "meson.build").read_text()).group(1),
    "conanfile.py": re.search(r'^\s+version = "([^"]+)"', (root / "conanfile.py").read_text(), re.M).group(1),
    "ports/ddp/vcpkg.json": json.loads((root / "ports/ddp/vcpkg.json").read_text())["version-semver"],
    "CHANGELOG.md": re.search(r"^## \[?(\d+\.\d+\.\d+)", (root / "CHANGELOG.md").read_text(), re.M).group(1),
}
bad = {k: v for k, v in found.items() if v != version}
# meson.build lists the unit test sources by hand: it must list every one.
meson = (root / "meson.build").read_text()
for test in sorted((root / "tests/unit").glob("*.cpp")):
    if f"'tests/unit/{test.name}'" not in meson:
        bad[f"meson.build (unit_sources lacks tests/unit/{test.name})"] = "missing"
for k, v in bad.items():
    print(f"{k} says {v}, include/ddp/version.hpp says {version}", file=sys.stderr)
if not bad:
    print(f"all versions agree: {version}")
sys.exit(1 if bad else 0)
