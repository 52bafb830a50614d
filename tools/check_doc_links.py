"""Every repository path that the documentation cites exists.

Scans README.md, NOTES.md, docs/, tools/README.md and examples/README.md for paths under the repository's
top-level folders (`benchmarks/results/...png`, `cuda/kernels/sm90/...`, `tools/gpu_check.sh`, ...), expands
`{a,b}` alternatives and `*` globs, and reports each one that matches no file or folder. A path is a name with an
extension (or a glob) or a folder written with a trailing slash. Skipped: paths followed by a placeholder
(`llama_block-<device>-<date>.json`) and paths written as `COMMIT:path`, which name a file kept only in git
history (removed from the tree); with --git those are checked with `git cat-file -e` instead.

    python3 tools/check_doc_links.py [--git]

tests/test_docs_links.py runs the in-tree check on the CPU.
"""

import argparse
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "NOTES.md", "docs/*.md", "docs/**/*.md", "tools/README.md", "examples/README.md"]
TOP = r"(?:benchmarks|tools|cuda|tests|examples|jax_flash|docs|\.ci)"
# A path starts after a character that cannot be part of a longer path (so `../shared/x` and `a/cuda/x` are not
# read as repository paths), optionally behind `COMMIT:`, and ends on a character a file name ends with.
PATH_RE = re.compile(r"(?<![\w./:{-])(?:(?P<commit>[0-9a-f]{7,40}):)?"
                     r"(?P<path>" + TOP + r"/(?:[\w./{},*+-]*[\w*}/])?)")


def doc_files(root=ROOT):
    seen = []
    for pattern in DOCS:
        for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
            if path not in seen:
                seen.append(path)
    return seen


def expand(path):
    """`a/{b,c}.md` -> [a/b.md, a/c.md] (nested and repeated groups too)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in expand(path[:m.start()] + alt + path[m.end():])]


def citations(text):
    """(line number, commit or None, path as written) for every repository path cited in text."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in PATH_RE.finditer(line):
            path = m.group("path")
            rest = line[m.end():]
            if re.match(r"[\w.+-]*<", rest) or rest.startswith("...") or "..." in path:
                continue  # a placeholder (`<device>`) or an abbreviation, not a file name
            last = path.rstrip("/").rsplit("/", 1)[-1]
            if not (path.endswith("/") or any(c in last for c in ".*}")):
                continue  # `jax_flash/cudnn` is a ratio; a file has an extension, a folder a trailing slash
            out.append((lineno, m.group("commit"), path))
    return out


def exists(root, path):
    if path.count("{") != path.count("}"):
        return False
    for p in expand(path):
        p = p.rstrip("/") or p
        if not glob.glob(os.path.join(root, p)):
            return False
    return True


def missing(root=ROOT, check_git=False):
    """['doc:line: path' ...] for every cited path that does not exist (and, with check_git, every COMMIT:path
    that git does not have)."""
    bad = []
    for doc in doc_files(root):
        with open(doc, encoding="utf-8") as f:
            text = f.read()
        rel = os.path.relpath(doc, root)
        for lineno, commit, path in citations(text):
            if commit is None:
                if not exists(root, path):
                    bad.append(f"{rel}:{lineno}: {path}")
            elif check_git:
                for p in expand(path):
                    r = subprocess.run(["git", "-C", root, "cat-file", "-e", f"{commit}:{p}"], capture_output=True)
                    if r.returncode:
                        bad.append(f"{rel}:{lineno}: {commit}:{p} (not in git)")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--git", action="store_true", help="also check COMMIT:path citations against git history")
    args = ap.parse_args()
    bad = missing(check_git=args.git)
    for line in bad:
        print(line)
    n = sum(len(citations(open(d, encoding="utf-8").read())) for d in doc_files())
    print(f"{n} citations in {len(doc_files())} files, {len(bad)} missing", file=sys.stderr)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
