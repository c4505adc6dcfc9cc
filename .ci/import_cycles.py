#!/usr/bin/env python3
"""No circular imports between files: run by `make lint`.

For each crate under services/ and shared/, every source file is a node, and a file that names
an item of another file of the same crate (`crate::a::b`, `super::x`, `self::m` or a sibling
module by its name after `use`) is an edge. A module's declaration (`mod x;`) and its re-exports
(`pub use x::...`) are not uses. Any cycle fails, with its files.
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_of(src_root, path):
    rel = path.relative_to(src_root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def strip(text):
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    # test modules use what they test; they are not the file's imports
    i = text.find("#[cfg(test)]")
    return text if i < 0 else text[:i]


def paths_used(text):
    """Module paths the text names, as tuples, with how they start (crate, super, self)."""
    for m in re.finditer(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)", text):
        yield m.group(1), tuple(m.group(2).strip(":").split("::"))
    # use lists: `use crate::a::{b, c::d}`
    for m in re.finditer(r"\buse\s+(crate|super|self)::([^;]*)\{([^;]*)\};", text):
        base = tuple(p for p in m.group(2).strip(":").split("::") if p)
        for item in re.split(r"[,\s]+", m.group(3)):
            item = item.strip("{} ")
            if item and item != "self":
                yield m.group(1), base + tuple(item.split("::"))


def resolve(kind, path, here, modules):
    if kind == "crate":
        full = path
    elif kind == "self":
        full = here + path
    else:  # super, possibly repeated
        base = here[:-1]
        while path and path[0] == "super":
            base, path = base[:-1], path[1:]
        full = base + path
    # the longest prefix that is a module file
    for n in range(len(full), -1, -1):
        if full[:n] in modules:
            return full[:n]
    return None


def crate_graph(src_root):
    files = {module_of(src_root, p): p for p in src_root.rglob("*.rs")}
    edges = {m: set() for m in files}
    for m, p in files.items():
        text = strip(p.read_text())
        text_no_reexports = re.sub(r"\bpub(\([^)]*\))?\s+use\s+[^;]*;", "", text)
        for kind, path in paths_used(text_no_reexports):
            target = resolve(kind, path, m, files)
            if target is not None and target != m:
                edges[m].add(target)
        # child modules named without a prefix: `use child::X`, `child::f()`
        children = set(re.findall(r"\bmod\s+([a-z_][a-z0-9_]*)\s*;", text))
        for child in children:
            if (m + (child,)) in files and re.search(
                r"(?<![:\w])" + child + r"::", text_no_reexports
            ):
                edges[m].add(m + (child,))
    return files, edges


def cycles(edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main():
    found = []
    for src in sorted(ROOT.glob("services/*/src")) + sorted(ROOT.glob("shared/*/src")):
        files, edges = crate_graph(src)
        for comp in cycles(edges):
            names = sorted(str(files[m].relative_to(ROOT)) for m in comp)
            found.append(names)
    for names in found:
        print("import_cycles: files that import each other: " + ", ".join(names))
    if found:
        sys.exit(1)
    print("import_cycles: no file imports another that imports it back")


if __name__ == "__main__":
    main()
