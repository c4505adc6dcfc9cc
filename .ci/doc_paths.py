#!/usr/bin/env python3
"""Every path a document names exists: run by `make check`.

A document is any tracked Markdown file. A path is a link target or a code span that looks like
one (a slash or a file extension, nothing a URL, a subject or a placeholder would hold). It must
exist from the repository's root or from the document's folder; a bare or partial path (such as
`decode/chunk.rs` in a paragraph about the worker) must be the end of some tracked path. Paths
under the folders set-up and builds make (.cache, target, .gpu) are not checked, nor examples
the reader fills in (`path/to/...`).
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTENSIONS = ("rs", "md", "py", "sh", "toml", "yml", "yaml", "conf", "json", "txt", "lock")
GENERATED = (".cache/", "target/", ".gpu/", "/", "~", "path/to/", "fuzz/corpus/", "fuzz/target/")
PATHLIKE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_./-]*$")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
TOP = {"docs", "lab", "deploy", "services", "shared", "tests", "fuzz"}
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = out.stdout.split()
    dirs = {str(Path(f).parent) for f in files}
    for d in list(dirs):
        parts = Path(d).parts
        dirs.update(str(Path(*parts[:i])) for i in range(1, len(parts)))
    return set(files), dirs


def candidates(text):
    """Link targets, and code spans with a file extension or under a top-level folder (so that
    `http/json` or `text/event-stream` are not taken for paths)."""
    # Fenced code blocks hold commands, not references.
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for m in LINK.finditer(text):
        target = m.group(1)
        if "://" not in target and not target.startswith("mailto:"):
            yield target
    for m in CODE_SPAN.finditer(text):
        span = m.group(1).strip()
        if not PATHLIKE.match(span) or span.endswith("."):
            continue
        has_extension = "." in span and span.rsplit(".", 1)[-1] in EXTENSIONS
        if has_extension or "/" in span and span.split("/")[0] in TOP:
            yield span


def exists(path, doc_dir, files, dirs):
    p = path.rstrip("/")
    for base in ("", doc_dir):
        full = str(Path(base) / p) if base else p
        full = str(Path(full))
        if full in files or full in dirs:
            return True
        # a link from docs/ to ../X
        if (ROOT / base / p).exists() and (ROOT / base / p).resolve().is_relative_to(ROOT):
            rel = str((ROOT / base / p).resolve().relative_to(ROOT))
            if rel in files or rel in dirs:
                return True
    suffix = "/" + p
    return any(f.endswith(suffix) for f in files) or any(d.endswith(suffix) for d in dirs)


def main():
    files, dirs = tracked()
    TOP.update(d for d in dirs if "/" not in d)
    missing = []
    for doc in sorted(f for f in files if f.endswith(".md")):
        doc_dir = str(Path(doc).parent) if "/" in doc else ""
        text = (ROOT / doc).read_text()
        for path in candidates(text):
            if path.startswith(GENERATED) or path.startswith("./.cache"):
                continue
            if not exists(path, doc_dir, files, dirs):
                missing.append(f"{doc}: {path}")
    for m in missing:
        print(f"doc_paths: no such path: {m}")
    if missing:
        sys.exit(1)
    print(f"doc_paths: every path named in {sum(f.endswith('.md') for f in files)} documents exists")


if __name__ == "__main__":
    main()
