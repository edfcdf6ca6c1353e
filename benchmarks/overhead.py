"""The overhead benchmark: what ddplab itself costs, in sections chosen by the first argument.

    torchrun --nproc_per_node=2 benchmarks/overhead.py [step] [flags]   # the whole step against hand-written loops
    torchrun --nproc_per_node=1 benchmarks/overhead.py link [flags]     # network=<preset>: per collective, per step
    torchrun --nproc_per_node=2 benchmarks/overhead.py row [flags]      # a logged row, in rounds and taken apart
    python benchmarks/overhead.py pieces [flags]                        # the step path's bookkeeping, µs per piece
    torchrun --nproc_per_node=1 benchmarks/overhead.py sampled [flags]  # the sampled step in place, phase by phase
    torchrun --nproc_per_node=2 benchmarks/overhead.py clip [flags]     # trainer.max_grad_norm, per strategy
    python benchmarks/overhead.py command [flags]                       # how long a bad command takes to refuse
    python benchmarks/overhead.py flight [flags]                        # the hang report's cost: recorder on / off
    python benchmarks/overhead.py <section> --help                      # a section's own flags

Each section is a module of its own (benchmarks/parts/overhead_<section>.py, its docstring says what it
measures and how); they share the two implementations they time (parts/overhead_loops.py) and the way
rounds are timed (parts/rounds.py). `pieces` and `command` run in one process, the others under
torchrun. docs/performance.md has each section's command; benchmarks/results/ the measurements.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

SECTIONS = {
    "step": "benchmarks.parts.overhead_step",
    "link": "benchmarks.parts.overhead_link",
    "row": "benchmarks.parts.overhead_row",
    "pieces": "benchmarks.parts.overhead_pieces",
    "sampled": "benchmarks.parts.overhead_sampled",
    "clip": "benchmarks.parts.overhead_clip",
    "command": "benchmarks.parts.overhead_command",
    "flight": "benchmarks.parts.overhead_flight",
}
DEFAULT = "step"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the section the first argument names (none, or a flag first: the step section) with the rest."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    section = args.pop(0) if args and not args[0].startswith("-") else DEFAULT
    if section not in SECTIONS:
        print(f"overhead.py: unknown section {section!r}; accepted: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    importlib.import_module(SECTIONS[section]).main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
