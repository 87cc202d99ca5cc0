#!/usr/bin/env python3
"""Checks the shape of include/ddp from its #include lines.

Each folder directly under include/ddp is one room, and so is each header at the top level. A
room stands on every room it includes; its floor is one above the highest of them. The rules:

  * no circle between headers, and no circle between rooms (an include that runs back up);
  * at most MAX_FLOORS floors;
  * one concern per file: a header (or .ipp) longer than MAX_LINES lines is a warning, unless it
    is in LONG with the reason one concern needs the room; no file of the tools (tools/*.hpp,
    *.cpp, *.py) over MAX_LINES;
  * a header reads as declarations: its non-template bodies are in its .ipp (X.hpp's in
    impl/X.ipp beside it), which the header includes at its bottom under `#if DDP_BODIES` and
    nothing else includes; no other `#if DDP_BODIES` in a header, and no DDP_INLINE function
    defined in one (in the separate-compilation mode it would be defined in every unit);
  * impl/src.hpp (the separate-compilation mode's implementation unit) includes what ddp.hpp
    includes, no more, no less.

    tools/check_layout.py            check, print the floors, exit 1 on a broken rule
    tools/check_layout.py --quiet    only the verdict and what breaks
    tools/check_layout.py --self-test   the rules on where bodies live, on planted trees
"""
import os
import re
import sys

MAX_FLOORS = 10
MAX_LINES = 650
# Files over MAX_LINES that one concern needs, each with its reason (and the most lines it may
# have: it may shrink, never grow past that without a new look at the reason).
LONG = {
    # The Communicator class: its collectives' declarations and their docs, one concern.
    "ddp/communicator.hpp": (660, "the Communicator class's declarations and docs"),
    # The bucket engine's class template (bodies of a template stay with it): one concern.
    "ddp/training/averaging/buckets.hpp": (655, "the bucket engine, a class template"),
    # FullyShardedAverager's class template: gather, reduce, step, save and load of units.
    "ddp/training/fully_sharded/fully_sharded.hpp": (670, "FullyShardedAverager, a class template"),
}
# Headers whose DDP_BODIES blocks are not bodies of their own declarations: the mode switch
# itself, and the explicit instantiations of the separate-compilation mode.
MODE_HEADERS = {"ddp/config.hpp", "ddp/instances.hpp", "ddp/ddp.hpp", "ddp/impl/src.hpp"}
BODIES_IF = re.compile(r"^\s*#\s*if\s+DDP_BODIES\s*$", re.M)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "include")
TOOLS = os.path.dirname(os.path.abspath(__file__))
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](ddp/[^>"]+)[>"]', re.M)


def headers():
    out = {}
    base = os.path.join(ROOT, "ddp")
    for dirpath, _, files in os.walk(base):
        for f in files:
            if f.endswith((".hpp", ".h", ".ipp")):
                full = os.path.join(dirpath, f)
                out[os.path.relpath(full, ROOT).replace(os.sep, "/")] = full
    return out


def header_of(ipp):
    """ddp/x/impl/y.ipp -> ddp/x/y.hpp (ddp/impl/y.ipp -> ddp/y.hpp)."""
    d, f = ipp.rsplit("/", 1)
    return d[: -len("/impl")] + "/" + f[: -len(".ipp")] + ".hpp"


def ipp_of(header):
    d, f = header.rsplit("/", 1)
    return d + "/impl/" + f[: -len(".hpp")] + ".ipp"


def room_of(header):
    if header.endswith(".ipp"):
        header = header_of(header)
    parts = header.split("/")  # ddp/<room or file>/...
    return parts[1] + "/" if len(parts) > 2 else parts[1]


def strip_code(text):
    """The text without comments, string and character literals (raw strings included)."""
    text = re.sub(r'R"([^()\\ ]{0,16})\((.|\n)*?\)\1"', '""', text)
    return re.sub(r'//[^\n]*|/\*(.|\n)*?\*/|"(\\.|[^"\\\n])*"|\'(\\.|[^\'\\\n])*\'',
                  lambda m: "\n" * m.group(0).count("\n"), text)


def defined_inline(code):
    """Line numbers (1-based) of DDP_INLINE functions that have a body in `code`."""
    out = []
    for m in re.finditer(r"\bDDP_INLINE\b", code):
        depth = 0
        for ch in code[m.end():]:
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
            elif depth == 0 and ch in ";{":
                if ch == "{":
                    out.append(code.count("\n", 0, m.start()) + 1)
                break
            elif depth == 0 and ch == "=":  # = default, = delete, = 0, a variable's value
                break
    return out


def bodies_problems(files):
    """The rules on where bodies live (see the module's doc)."""
    problems = []
    for h, full in sorted(files.items()):
        text = open(full, encoding="utf-8").read()
        if h.endswith(".ipp"):
            owner = header_of(h)
            if owner not in files:
                problems.append(f"{h}: no header {owner} beside it")
            for other, other_full in files.items():
                if other != owner and re.search(r'#\s*include\s*[<"]' + re.escape(h) + '[>"]',
                                                open(other_full, encoding="utf-8").read()):
                    problems.append(f"{other} includes {h}: only {owner} may (at its bottom)")
            continue
        if h in MODE_HEADERS:
            continue
        code = strip_code(text)
        for line in defined_inline(code):
            problems.append(f"{h}:{line}: a DDP_INLINE function defined in a header: move its "
                            f"body to {ipp_of(h)}")
        ifs = [code.count("\n", 0, m.start()) + 1 for m in BODIES_IF.finditer(code)]
        tail = f'#if DDP_BODIES\n#include "{ipp_of(h)}"\n#endif\n'
        if ipp_of(h) in files and not text.endswith(tail):
            problems.append(f"{h}: must end with: " + tail.replace("\n", " | "))
        allowed = 1 if ipp_of(h) in files else 0
        for line in ifs[: len(ifs) - allowed] if allowed else ifs:
            problems.append(f"{h}:{line}: an #if DDP_BODIES block in a header: its body belongs "
                            f"in {ipp_of(h)}")
    return problems


def strongly_connected(nodes, edges):
    """Tarjan's algorithm, iterative; returns the components with more than one node or a self
    edge."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = [0]
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    n = stack.pop()
                    on_stack.discard(n)
                    comp.append(n)
                    if n == node:
                        break
                if len(comp) > 1 or node in edges.get(node, ()):
                    comps.append(sorted(comp))
    return comps


def self_test():
    """The bodies rules on small planted trees: each mistake is caught, a right tree passes."""
    import tempfile
    good_h = ('#pragma once\n#include "ddp/config.hpp"\nDDP_BEGIN_NAMESPACE\n'
              'DDP_INLINE void f(int x = {});\nDDP_INLINE int g() = delete;\n'
              'inline int h() { return 1; }\nDDP_END_NAMESPACE\n'
              '#if DDP_BODIES\n#include "ddp/x/impl/a.ipp"\n#endif\n')
    good_ipp = '#pragma once\nDDP_BEGIN_NAMESPACE\nDDP_INLINE void f(int) {}\nDDP_END_NAMESPACE\n'
    cases = {
        "right": ({"ddp/x/a.hpp": good_h, "ddp/x/impl/a.ipp": good_ipp}, []),
        "a body in the header": ({"ddp/x/a.hpp": good_h.replace("f(int x = {});",
                                                                "f(int x = {}) { (void)x; }"),
                                  "ddp/x/impl/a.ipp": good_ipp}, ["defined in a header"]),
        "a body in a comment is none": ({"ddp/x/a.hpp": good_h.replace(
            "DDP_END", "// DDP_INLINE void k() {}\nDDP_END"), "ddp/x/impl/a.ipp": good_ipp}, []),
        "a DDP_BODIES block": ({"ddp/x/a.hpp": good_h.replace(
            "DDP_END_NAMESPACE\n#if", "#if DDP_BODIES\nDDP_INLINE void f(int) {}\n#endif\n"
            "DDP_END_NAMESPACE\n#if"), "ddp/x/impl/a.ipp": good_ipp}, ["block in a header"]),
        "the .ipp not at the bottom": ({"ddp/x/a.hpp": good_h + "int tail;\n",
                                        "ddp/x/impl/a.ipp": good_ipp}, ["must end with"]),
        "an .ipp included elsewhere": ({"ddp/x/a.hpp": good_h, "ddp/x/impl/a.ipp": good_ipp,
                                        "ddp/x/b.hpp": '#include "ddp/x/impl/a.ipp"\n'},
                                       ["only ddp/x/a.hpp may"]),
        "an .ipp without a header": ({"ddp/x/impl/c.ipp": good_ipp}, ["no header"]),
    }
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, (tree, wanted) in cases.items():
            files = {}
            for rel, text in tree.items():
                full = os.path.join(tmp, name.replace(" ", "_"), rel)
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "w", encoding="utf-8") as f:
                    f.write(text)
                files[rel] = full
            got = bodies_problems(files)
            ok = (not got) if not wanted else all(any(w in p for p in got) for w in wanted)
            print(f"{'ok  ' if ok else 'FAIL'} {name}: {got or 'no problem'}")
            failed += not ok
    return 1 if failed else 0


def main():
    if "--self-test" in sys.argv:
        return self_test()
    quiet = "--quiet" in sys.argv
    files = headers()
    file_edges, room_edges, why = {}, {}, {}
    problems, warnings = bodies_problems(files), []
    for h, full in sorted(files.items()):
        text = open(full, encoding="utf-8").read()
        lines = text.count("\n")
        if h in LONG:
            if lines > LONG[h][0]:
                problems.append(f"{h}: {lines} lines, more than the {LONG[h][0]} LONG allows")
            elif lines <= MAX_LINES:
                problems.append(f"{h}: {lines} lines now: take it off LONG")
        elif lines > MAX_LINES:
            warnings.append(f"{h}: {lines} lines: more than one concern? Split it by concern, or "
                            f"list it in LONG with the reason one concern needs the room")
        for inc in INCLUDE.findall(text):
            if inc not in files:
                continue  # a header of another project (or generated): not a room of this house
            if inc.endswith(".ipp"):
                continue  # a header's own bodies: the same file, in the graph
            file_edges.setdefault(header_of(h) if h.endswith(".ipp") else h,
                                  set()).add(inc)
            a, b = room_of(h), room_of(inc)
            if a != b:
                room_edges.setdefault(a, set()).add(b)
                why.setdefault((a, b), f"{h} -> {inc}")
    for name in sorted(os.path.relpath(os.path.join(d, f), TOOLS) for d, _, fs in os.walk(TOOLS)
                       for f in fs):
        if name.endswith((".hpp", ".cpp", ".py")):
            lines = open(os.path.join(TOOLS, name), encoding="utf-8").read().count("\n")
            if lines > MAX_LINES:
                problems.append(f"tools/{name}: {lines} lines (at most {MAX_LINES})")
    if "ddp/impl/src.hpp" in files:
        umbrella, impl = file_edges.get("ddp/ddp.hpp", set()), file_edges.get("ddp/impl/src.hpp", set())
        for h in sorted(umbrella ^ impl):
            problems.append(f"ddp/impl/src.hpp and ddp/ddp.hpp include different headers: {h} is "
                            f"in {'ddp.hpp' if h in umbrella else 'impl/src.hpp'} only")
    for w in warnings:
        print("warning: " + w)
    for comp in strongly_connected(sorted(f for f in files if not f.endswith(".ipp")), file_edges):
        problems.append("headers include each other in a circle: " + ", ".join(comp))
    rooms = sorted({room_of(h) for h in files})
    headers_only = [h for h in files if not h.endswith(".ipp")]
    room_cycles = strongly_connected(rooms, room_edges)
    for comp in room_cycles:
        inside = set(comp)
        arrows = sorted(why[(a, b)] for a in comp for b in room_edges.get(a, ()) if b in inside)
        problems.append("rooms include each other (an include runs back up): " + ", ".join(comp) +
                        " — " + "; ".join(arrows))
    floors = {}
    if not room_cycles:
        def floor(r, seen=()):
            if r not in floors:
                floors[r] = 1 + max((floor(d) for d in room_edges.get(r, ())), default=0)
            return floors[r]

        for r in rooms:
            floor(r)
        top = max(floors.values())
        if top > MAX_FLOORS:
            problems.append(f"{top} floors (at most {MAX_FLOORS})")
        if not quiet:
            for f in range(top, 0, -1):
                print(f"floor {f:2}: " + "  ".join(r for r in rooms if floors[r] == f))
    if problems:
        print("include/ddp breaks its layout rules:")
        for p in problems:
            print("  " + p)
        return 1
    ipps = len(files) - len(headers_only)
    print(f"include/ddp: {len(headers_only)} headers and {ipps} .ipp files of their bodies, "
          f"{len(rooms)} rooms on {max(floors.values())} floors, no circle, every body in its "
          f".ipp; {len(warnings)} file(s) over {MAX_LINES} lines, {len(LONG)} listed in LONG")
    return 0


if __name__ == "__main__":
    sys.exit(main())
