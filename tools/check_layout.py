#!/usr/bin/env python3
"""Checks the shape of include/ddp from its #include lines.

Each folder directly under include/ddp is one room, and so is each header at the top level. A
room stands on every room it includes; its floor is one above the highest of them. The rules:

  * no circle between headers, and no circle between rooms (an include that runs back up);
  * at most MAX_FLOORS floors;
  * no header longer than MAX_LINES lines (those in STILL_LONG: no longer than they are now), and
    no file of the tools (tools/*.hpp, *.cpp, *.py) either;
  * impl/src.hpp (the separate-compilation mode's implementation unit) includes what ddp.hpp
    includes, no more, no less.

    tools/check_layout.py            check, print the floors, exit 1 on a broken rule
    tools/check_layout.py --quiet    only the verdict and what breaks
"""
import os
import re
import sys

MAX_FLOORS = 10
MAX_LINES = 650
# Headers still over MAX_LINES, each with the most lines it may have until it is split: they may
# shrink, never grow, and one that fits MAX_LINES must leave this list.
STILL_LONG = {
    # The Communicator class's declarations and their docs: one concern.
    "ddp/communicator.hpp": 655,
}

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "include")
TOOLS = os.path.dirname(os.path.abspath(__file__))
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](ddp/[^>"]+)[>"]', re.M)


def headers():
    out = {}
    base = os.path.join(ROOT, "ddp")
    for dirpath, _, files in os.walk(base):
        for f in files:
            if f.endswith((".hpp", ".h")):
                full = os.path.join(dirpath, f)
                out[os.path.relpath(full, ROOT).replace(os.sep, "/")] = full
    return out


def room_of(header):
    parts = header.split("/")  # ddp/<room or file>/...
    return parts[1] + "/" if len(parts) > 2 else parts[1]


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


def main():
    quiet = "--quiet" in sys.argv
    files = headers()
    file_edges, room_edges, why = {}, {}, {}
    problems = []
    for h, full in sorted(files.items()):
        text = open(full, encoding="utf-8").read()
        lines = text.count("\n")
        limit = STILL_LONG.get(h, MAX_LINES)
        if lines > limit:
            problems.append(f"{h}: {lines} lines (at most {limit})")
        elif h in STILL_LONG and lines <= MAX_LINES:
            problems.append(f"{h}: {lines} lines now: take it off STILL_LONG")
        for inc in INCLUDE.findall(text):
            if inc not in files:
                continue  # a header of another project (or generated): not a room of this house
            file_edges.setdefault(h, set()).add(inc)
            a, b = room_of(h), room_of(inc)
            if a != b:
                room_edges.setdefault(a, set()).add(b)
                why.setdefault((a, b), f"{h} -> {inc}")
    for name in sorted(os.listdir(TOOLS)):
        if name.endswith((".hpp", ".cpp", ".py")):
            lines = open(os.path.join(TOOLS, name), encoding="utf-8").read().count("\n")
            if lines > MAX_LINES:
                problems.append(f"tools/{name}: {lines} lines (at most {MAX_LINES})")
    if "ddp/impl/src.hpp" in files:
        umbrella, impl = file_edges.get("ddp/ddp.hpp", set()), file_edges.get("ddp/impl/src.hpp", set())
        for h in sorted(umbrella ^ impl):
            problems.append(f"ddp/impl/src.hpp and ddp/ddp.hpp include different headers: {h} is "
                            f"in {'ddp.hpp' if h in umbrella else 'impl/src.hpp'} only")
    for comp in strongly_connected(sorted(files), file_edges):
        problems.append("headers include each other in a circle: " + ", ".join(comp))
    rooms = sorted({room_of(h) for h in files})
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
    long = "".join(f"; {h} still {STILL_LONG[h]}" for h in sorted(STILL_LONG))
    print(f"include/ddp: {len(files)} headers, {len(rooms)} rooms on {max(floors.values())} "
          f"floors, no circle, no header (nor file of tools/) over {MAX_LINES} lines{long}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
