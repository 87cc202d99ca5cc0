#!/usr/bin/env python3
"""Compiles every C++ block of README.md and docs/guide/*.md, so that the guide never shows code
that does not compile. A page gives its blocks their surroundings in a hidden context, an HTML
comment that holds a cpp block:

    <!-- guide context: ...
    ```cpp
    struct Net { ... };          // file scope: the types and helpers the blocks assume
    // each block:
    auto comm = ...;             // the locals every block of the page may use
    ```
    -->

A context applies to the blocks after it, up to the next context. Each block is compiled inside
`void block_N() { <locals> { <block> } }` with g++ -std=c++20 -fsyntax-only, against include/.
A block marked `<!-- guide: needs mpi -->` (or nccl, torch) just before it is compiled with that
backend's headers where they are installed and skipped, with a note, where they are not; one
marked `<!-- guide: file scope -->` (a specialization, a definition) is compiled at file scope,
one marked `<!-- guide: alone -->` as a unit of its own; a context whose first line says
`(needs torch)` passes that need to its blocks.
A block's #include lines go to the top of its unit. The
blocks that are whole examples (`<!-- the block below is examples/... -->`) are checked against
their sources by tools/check_readme.py and built by the build instead.

    tools/check_guide.py [--cxx g++] [--keep DIR]
"""
import argparse
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
CONTEXT = re.compile(r"<!-- guide context([^\n]*)\n```cpp\n(.*?)```\n-->", re.S)
BLOCK = re.compile(r"((?:[ ]*<!--[^\n]*-->\n)?)(?<=\n)(([ ]*)```cpp\n)(.*?)```", re.S)
EACH = "// each block:\n"


def flags_for(needs):
    """Compiler flags for a block's needs, or None where a need is not installed here."""
    flags = []
    for need in needs:
        if need == "mpi":
            mpicxx = shutil.which("mpicxx")
            if not mpicxx:
                return None
            out = subprocess.run([mpicxx, "--showme:compile"], capture_output=True, text=True)
            if out.returncode != 0:
                return None
            flags += out.stdout.split() + ["-DDDP_HAS_MPI=1", "-DOMPI_SKIP_MPICXX=1",
                                           "-DMPICH_SKIP_MPICXX=1"]
        elif need == "nccl":
            cuda = pathlib.Path("/usr/local/cuda/include")
            if not (cuda / "nccl.h").exists() and not pathlib.Path("/usr/include/nccl.h").exists():
                return None
            flags += [f"-I{cuda}", "-DDDP_HAS_CUDA=1", "-DDDP_HAS_NCCL=1"]
        elif need == "torch":
            base = pathlib.Path("/usr/include")
            if not (base / "torch" / "csrc" / "api" / "include" / "torch" / "torch.h").exists():
                return None
            flags += [f"-I{base / 'torch' / 'csrc' / 'api' / 'include'}"]
        else:
            raise SystemExit(f"unknown need: {need}")
    return flags


def units():
    """(page, [(number, needs, code)], context) for every page with blocks to compile."""
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        pieces = []  # (offset, kind, payload)
        for m in CONTEXT.finditer(text):
            needs = re.findall(r"\(needs ([a-z ]+)\)", m.group(1))
            pieces.append((m.start(), "context", (m.group(2), needs[0].split() if needs else [])))
        hidden = [(m.start(), m.end()) for m in CONTEXT.finditer(text)]
        for m in BLOCK.finditer(text):
            if any(a <= m.start() < b for a, b in hidden):
                continue
            marker = m.group(1)
            if "the block below is" in marker:
                continue
            needs = re.findall(r"needs ([a-z ]+?) -->", marker)
            scope = "file scope" if "file scope" in marker else "alone" if "alone" in marker else ""
            code = re.sub(r"(?m)^" + re.escape(m.group(3)), "", m.group(4))  # indented blocks
            pieces.append((m.start(), "block", (needs[0].split() if needs else [], code, scope)))
        context, blocks, groups, inherited = None, [], [], []
        for _, kind, payload in sorted(pieces, key=lambda p: p[0]):
            if kind == "context":
                if blocks:
                    groups.append((context, blocks))
                (context, inherited), blocks = payload, []
            else:
                needs, code, scope = payload
                blocks.append((sorted(set(needs) | set(inherited)), code, scope))
        if blocks:
            groups.append((context, blocks))
        for context, blocks in groups:
            out.append((page, context, blocks))
    return out


def source(page, context, blocks, needs):
    if len(blocks) == 1 and blocks[0][1] == "alone":  # the block is the whole unit
        return blocks[0][0] + "\n"
    if context is None:
        raise SystemExit(f"{page.relative_to(ROOT)}: a C++ block without a guide context before it")
    scope, _, locals_ = context.partition(EACH)
    lines = [f"// generated by tools/check_guide.py from {page.relative_to(ROOT)}",
             "#include <ddp/ddp.hpp>"]
    if "torch" in needs:
        lines.append("#include <ddp/adapters/torch.hpp>")
    # A block's own #include lines go to the top, where a program has them.
    for code, _ in blocks:
        lines += [l for l in code.splitlines() if l.startswith("#include")]
    lines += ["", scope]
    for code, at_file_scope in blocks:  # definitions (a tensor_traits specialization, say)
        if at_file_scope:
            lines.append(code)
    lines.append("namespace guide_blocks {")
    for n, (code, at_file_scope) in enumerate(blocks, 1):
        if at_file_scope:
            continue
        body = "\n".join(l for l in code.splitlines() if not l.startswith("#include"))
        lines += [f"[[maybe_unused]] void block_{n}() {{", locals_, "  {", body, "  }", "}"]
    lines += ["}  // namespace guide_blocks", "int main() { return 0; }", ""]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cxx", default="g++")
    parser.add_argument("--keep", help="write the generated sources to this directory")
    args = parser.parse_args()
    work = pathlib.Path(args.keep or tempfile.mkdtemp())
    work.mkdir(parents=True, exist_ok=True)
    failed, compiled, skipped = 0, 0, []
    for index, (page, context, blocks) in enumerate(units()):
        by_needs = {}
        for needs, code, scope in blocks:
            key = tuple(sorted(needs)) + (("alone", len(by_needs)) if scope == "alone" else ())
            by_needs.setdefault(key, []).append((code, scope))
        for key, group in by_needs.items():
            needs = [n for n in key if isinstance(n, str) and n != "alone"]
            flags = flags_for(needs)
            name = page.stem + ("-" + "-".join(needs) if needs else "") + (
                f"-alone{key[-1]}" if "alone" in key else "")
            if flags is None:
                skipped.append(f"{page.relative_to(ROOT)} ({len(group)} block(s) needing "
                               f"{', '.join(needs)}: not installed here)")
                continue
            path = work / f"{index}-{name}.cpp"
            path.write_text(source(page, context, group, needs), encoding="utf-8")
            cmd = [args.cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
                   "-Wno-unused-variable", "-Wno-unused-but-set-variable", "-Wno-unused-parameter",
                   f"-I{ROOT / 'include'}", *flags, str(path)]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                failed += 1
                print(f"{page.relative_to(ROOT)}: its blocks do not compile ({path}):\n"
                      + "\n".join(run.stderr.splitlines()[:30]), file=sys.stderr)
            else:
                compiled += len(group)
    for s in skipped:
        print("skipped: " + s)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        return 1
    print(f"{compiled} C++ blocks of README.md and docs/guide/ compile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
