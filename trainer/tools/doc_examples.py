"""The docs' example sessions, made again from the commands they show.

    python -m trainer.tools.doc_examples docs/memory.md            # rewrite each example's output
    python -m trainer.tools.doc_examples docs/memory.md --check    # exit 1 naming each example that differs

An example is a fenced block whose first line is `$ python -m <module> <args>` (continued onto more
lines with backslashes) for a module whose output is the same on every run (EXAMPLES: the memory
predictor reads shapes, not clocks); the rest of the block is that command's output. Each is run
in-process and its output put in the block, so the docs say what the tool prints today
(tests/test_docs.py runs the check).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

EXAMPLES = ("trainer.tools.memory",)  # modules whose output depends on their arguments alone
BLOCK = re.compile(r"```\n(\$ python -m (\S+)(?:[^\n]*\\\n)*[^\n]*)\n(.*?)```", re.S)


def output_of(module: str, command: str) -> str:
    """What `command` (the block's first lines, `$ python -m module args`) prints, run in-process."""
    args = shlex.split(command.replace("\\\n", " "))[4:]  # after `$ python -m <module>`
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = importlib.import_module(module).main(args)
    if code:
        raise SystemExit(f"doc_examples: `{command.splitlines()[0]}` exited {code}")
    return out.getvalue()


def refreshed(text: str) -> tuple[str, list[str]]:
    """The text with every example's output made again, and the first line of each that changed."""
    changed: list[str] = []

    def redo(match: re.Match[str]) -> str:
        command, module, old = match.group(1), match.group(2), match.group(3)
        if module not in EXAMPLES:
            return match.group(0)
        new = output_of(module, command)
        if new != old:
            changed.append(command.splitlines()[0])
        return f"```\n{command}\n{new}```"

    return BLOCK.sub(redo, text), changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.doc_examples", description=__doc__.splitlines()[0])
    parser.add_argument("docs", nargs="+", type=Path, help="markdown files whose examples to make again")
    parser.add_argument("--check", action="store_true", help="change nothing: exit 1 if an example differs")
    args = parser.parse_args(argv)
    stale = []
    for path in args.docs:
        text, changed = refreshed(path.read_text())
        stale += [f"{path}: {line}" for line in changed]
        if changed and not args.check:
            path.write_text(text)
    for line in stale:
        print(("differs: " if args.check else "made again: ") + line)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
