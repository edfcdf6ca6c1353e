"""The oldest torch the lab runs on, checked before torch is imported: an older one is one line and exit 2.

train.py (every process, before Hydra or torch is imported) and the launcher (before any worker starts)
call refuse_old_torch(). The version is read from the installed distribution's metadata, as pip reads
it, so the check costs milliseconds and runs before an older torch could fail on an import of its own
(torch.distributed.checkpoint.CheckpointableTensor, ProcessGroup.register_pre_hook: new in 2.14).
Only the standard library: this runs first.
"""

from __future__ import annotations

import os
import re
import sys
from importlib import metadata

# The oldest torch the whole suite passes on, and its torchvision; pyproject.toml says the same
# (tests/test_setup_refusals.py holds the two together).
TORCH_FLOOR = (2, 14)
TORCHVISION_FLOOR = (0, 29)
EXIT_CODE = 2


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


REQUIREMENTS = f"'torch>={dotted(TORCH_FLOOR)}' 'torchvision>={dotted(TORCHVISION_FLOOR)}'"


def release(version: str) -> tuple[int, ...]:
    """A version's release numbers: '2.13.0+cpu' -> (2, 13, 0); a pre-release or a source build counts
    as its release ('2.14.0a0+git1a2b3c', '2.14.0.dev20260101' -> (2, 14, 0))."""
    numbers = []
    for piece in version.partition("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        numbers.append(int(digits[0]))
        if digits[0] != piece:  # "0a0", "0rc1": the release ends here
            break
    return tuple(numbers)


def refusal(found: str | None) -> str | None:
    """The one line that refuses this torch (its version, None: not installed), or None if it will do."""
    if found is not None and release(found) >= TORCH_FLOOR:
        return None
    has = f"torch {found}" if found is not None else "no torch"
    return (
        f"ddplab needs torch>={dotted(TORCH_FLOOR)}, and {sys.executable} has {has}: `make setup` installs it "
        f"(in a venv of your own: pip install {REQUIREMENTS})"
    )


def installed_torch() -> str | None:
    """The version of the torch this interpreter would import, from its metadata (torch is not imported)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def refuse_old_torch() -> None:
    """Exit 2 with one line on stderr if the installed torch is older than the floor. Each node's first
    rank says it (LOCAL_RANK 0, or a lone process): the torch installed is a fact of each machine."""
    line = refusal(installed_torch())
    if line is None:
        return
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CODE)
