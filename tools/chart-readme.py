#!/usr/bin/env python3
"""chart-readme: the values table of charts/culvert/README.md, generated from values.yaml.

    tools/chart-readme.py           rewrite the part of the README between the VALUES markers
    tools/chart-readme.py --check   exit 1 (with a diff) when the README is not what it would write

Each key's description is the comment block right above it in values.yaml (a blank line ends a
block, so section comments stay out). A map whose keys have no comments of their own is one row
with its whole default; otherwise each key is a row. values.yaml is block YAML without lists or
trailing comments (scripts/check-manifests runs --check, so a line this cannot read fails there).
Python standard library only.
"""
import difflib
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
VALUES = os.path.join(ROOT, "charts/culvert/values.yaml")
README = os.path.join(ROOT, "charts/culvert/README.md")
BEGIN = "<!-- BEGIN VALUES: generated from values.yaml by `make chart-readme`; do not edit by hand -->"
END = "<!-- END VALUES -->"
KEY = re.compile(r"^( *)([A-Za-z0-9_./-]+):(?: (.*))?$")


class Node:
    def __init__(self, path, comment, value):
        self.path, self.comment, self.value, self.children = path, comment, value, []

    def commented(self):
        return any(c.comment or c.commented() for c in self.children)


def parse(text):
    root = Node("", "", None)
    stack = [(-1, root)]
    comment = []
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            comment = []
            continue
        if stripped.startswith("#"):
            comment.append(stripped[1:].strip())
            continue
        m = KEY.match(line)
        if not m:
            sys.exit(f"chart-readme: values.yaml line {n} is not `key:` or `key: value`: {line!r}")
        indent, key, value = len(m.group(1)), m.group(2), m.group(3)
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        node = Node(f"{parent.path}.{key}" if parent.path else key, " ".join(comment), value)
        parent.children.append(node)
        if value is None:
            stack.append((indent, node))
        comment = []
    return root


def flow(node):
    if node.value is not None:
        return node.value
    return "{" + ", ".join(f"{c.path.rsplit('.', 1)[-1]}: {flow(c)}" for c in node.children) + "}"


def cell(text):
    return text.replace("|", "\\|")


def rows(node):
    for c in node.children:
        if c.value is None and c.commented():
            if c.comment:
                yield f"| `{c.path}` | | {cell(c.comment)} |"
            yield from rows(c)
        else:
            yield f"| `{c.path}` | `{cell(flow(c))}` | {cell(c.comment)} |"


def table():
    with open(VALUES) as f:
        root = parse(f.read())
    lines = ["| Key | Default | Description |", "|---|---|---|", *rows(root)]
    return "\n".join([BEGIN, "", *lines, "", END])


def main():
    with open(README) as f:
        old = f.read()
    if BEGIN not in old or END not in old:
        sys.exit(f"chart-readme: {README} lacks the markers {BEGIN!r} ... {END!r}")
    head, rest = old.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    new = head + table() + tail
    if sys.argv[1:] == ["--check"]:
        if new != old:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), README, "generated"))
            print("chart-readme: charts/culvert/README.md is out of date: run `make chart-readme`", file=sys.stderr)
            return 1
        return 0
    if new != old:
        with open(README + ".tmp", "w") as f:
            f.write(new)
        os.replace(README + ".tmp", README)
        print("chart-readme: wrote charts/culvert/README.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
