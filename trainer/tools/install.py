"""`make setup`'s installer: pip, then (TORCH=cpu) PyTorch's CPU-only torch, then `pip install -e '.[dev]'`,
into the running interpreter's venv, each step said on screen and pip's own output kept in a log.

    .venv/bin/python -m trainer.tools.install --stamp .venv/.installed            # what `make setup` runs
    .venv/bin/python -m trainer.tools.install --torch-index URL_OR_FOLDER ...     # TORCH=cpu
    .venv/bin/python -m trainer.tools.install --check     # only the last step: do torch and torchvision work?

Why two pips: pip unpacks and byte-compiles one wheel after another on one core, and the CUDA build of
torch brings 5.5 GB of them (torch, triton and the nvidia-* libraries), which is most of a new clone's
set-up. So pip resolves once (`--dry-run --report`: what it would install, nothing written), the wheels
are dealt to `--jobs` pips that install them with `--no-deps` side by side, and a last plain
`pip install -e '.[dev]'` installs the project itself and checks that every requirement is met, as if
it had done everything alone. What is already installed (TORCH=cpu's torch) is left as it is.

The screen gets a line per step, what it installs and about how long it takes (ESTIMATES), a line every
TICK_S seconds while wheels unpack, and the whole time; a failed step shows the log's last lines. The
stamp records which torch the venv holds (`torch=cpu 2.13.0+cpu`): pip does not swap a CUDA torch for
the CPU one in place (the nvidia-* libraries stay), so TORCH=cpu on a venv that holds the CUDA build is
refused before pip runs, with the command that rebuilds it.

What it installed is then checked, in a new process of the venv's python: torch and torchvision
import, and one of torchvision's operators runs (a torchvision built for another torch fails there,
`operator torchvision::nms does not exist`, while pip is content with the pair). A failure is one line
naming what failed and the command that fixes it, and no stamp. PyTorch's index (--torch-index) is
tried once, briefly, before pip: where it is unreachable that is said at once, with the sources pip
looks in next (its configuration's find-links and extra-index-url), and pip does not retry it. The last
line names where the torch it installed came from (the wheel's URL or path, from pip's report).
Only pip and the standard library (and trainer/setup/torch_version.py, which is the same): this runs
before anything else is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import IO
from urllib.parse import unquote, urlparse

from trainer.setup.torch_version import TORCH_FLOOR, TORCHVISION_FLOOR, dotted, release

PROJECT = ".[dev]"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The times said on screen: each step of `make setup` on a fresh clone of the project's 2-core machine, from
# a quiet day to one with other work sharing the cores (seconds; unpacking: seconds per GB written to the venv).
MACHINE = "the project's 2-core machine"
ESTIMATES = {"upgrade": (5, 10), "resolve": (10, 50), "write_per_gb": (7, 34), "editable": (10, 15), "check": (5, 10)}
TICK_S = 15.0
PROBE_S = 5  # PyTorch's index gets one try this long before pip runs (pip's own: 5 retries of 180 s here)
TORCH = f"torch>={dotted(TORCH_FLOOR)}"
TORCHVISION = f"torchvision>={dotted(TORCHVISION_FLOOR)}"
WHERE_PIP_LOOKS = "`pip config list` shows where pip looks (index-url, extra-index-url, find-links)"
# What a CUDA build of torch requires on Linux: the CUDA libraries, as pip packages.
CUDA_PACKAGES = ("nvidia-", "nvidia_", "cuda-", "cuda_")
NO_CPU_WHEELS = (
    f"PyTorch's CPU-only wheels live on its CPU index, {CPU_INDEX}: where pip cannot reach it, set "
    "TORCH_CPU_INDEX to a mirror of that index or to a folder holding the torch and torchvision CPU wheels "
    "(make train TORCH=cpu TORCH_CPU_INDEX=$HOME/wheels), or leave TORCH unset for pip's default torch"
)


def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", *args]


def torch_build(version: str, requires: list[str], platform: str = sys.platform) -> str:
    """cpu, cuda or rocm: what a torch distribution runs on, from its version's label (PyTorch's own
    indexes: +cpu, +cu128, +rocm6.4) or else its requirements (PyPI's Linux torch is the CUDA build and
    names the nvidia-* libraries, for Linux only)."""
    label = version.partition("+")[2]
    if label.startswith("rocm"):
        return "rocm"
    if label.startswith("cu"):
        return "cuda"
    if label or platform != "linux":
        return "cpu"
    return "cuda" if any(r.lower().startswith(CUDA_PACKAGES) for r in requires) else "cpu"


def installed_torch() -> tuple[str, str] | None:
    """(version, build) of the torch this interpreter would import, read from its metadata (not imported)."""
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None
    return dist.version, torch_build(dist.version, dist.requires or [])


def planned_torch(report: dict) -> tuple[str, str, str] | None:
    """(version, build, where from) of the torch a pip report would install, or None."""
    for item in report["install"]:
        meta = item["metadata"]
        if meta["name"].lower() == "torch":
            build = torch_build(meta["version"], meta.get("requires_dist", []))
            return meta["version"], build, item["download_info"]["url"]
    return None


def cpu_torch(index: str) -> list[str]:
    """pip's arguments that install torch and torchvision (the lab's floor) from an index URL (their
    requirements too), or from a folder of wheels alone (their requirements then come with the project's)."""
    return [TORCH, TORCHVISION, *torch_source(index)]


def torch_source(index: str) -> list[str]:
    """pip's arguments that take torch from an index URL or from a folder of wheels alone."""
    folder = Path(index).expanduser()
    return ["--no-deps", "--no-index", "--find-links", str(folder)] if folder.is_dir() else ["--index-url", index]


def probe(index: str, timeout_s: float = PROBE_S) -> str | None:
    """Why an index URL cannot be reached, from one try of `timeout_s` (no retries), or None if it answers
    (an HTTP error is an answer: what the index holds is pip's to say). A file: URL is reached if it exists."""
    if index.startswith("file:"):
        path = Path(unquote(urlparse(index).path))
        return None if path.exists() else f"{path} does not exist"
    try:
        with urllib.request.urlopen(index, timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as err:  # URLError, a timeout, a refused connection, a malformed URL
        reason = getattr(err, "reason", err)
        return (
            f"no answer in {timeout_s} s" if isinstance(reason, TimeoutError) else str(reason) or type(reason).__name__
        )


def pip_sources() -> list[str]:
    """Where pip looks besides an --index-url: the find-links and extra-index-url of its configuration
    (its files and PIP_* variables, as `pip config list` shows them), each once."""
    listed = subprocess.run(pip("config", "list"), capture_output=True, text=True).stdout
    found: list[str] = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.rpartition(".")[2] in ("find-links", "extra-index-url"):
            found += [v for v in value.strip().strip("'\"").split() if v not in found]
    return found


def unreachable(index: str, why: str, others: list[str]) -> str:
    """The line that says PyTorch's index cannot be reached, and where pip looks instead."""
    where = (
        f"pip looks next in the sources it is configured with ({', '.join(others)}; `pip config list`)"
        if others
        else "pip is configured with no other source, so it will find none"
    )
    return f"PyTorch's index {index} is unreachable ({why}): {where}, and does not retry the index"


def shown(url: str) -> str:
    """A wheel's URL as a reader finds it: a local file's path, a download's URL, unquoted."""
    return unquote(urlparse(url).path) if url.startswith("file://") else unquote(url)


def planned_wheels(report: dict) -> list[str]:
    """The wheels a report would install, as paths or URLs pip accepts; the project itself (a local
    directory, installed editable by the last pip) is left out."""
    wheels = []
    for item in report["install"]:
        url = item["download_info"]["url"]
        if "dir_info" in item["download_info"]:
            continue
        wheels.append(unquote(urlparse(url).path) if url.startswith("file://") else url)
    return wheels


def size(wheel: str) -> int:
    """A local wheel's bytes; a download counts as none (the big ones lie on disk or come alone)."""
    path = Path(wheel)
    return path.stat().st_size if path.is_file() else 0


def unpacked_size(wheel: str) -> int:
    """A local wheel's bytes once unpacked, from its zip directory; a download counts as none."""
    if not Path(wheel).is_file():
        return 0
    with zipfile.ZipFile(wheel) as archive:
        return sum(info.file_size for info in archive.infolist())


def deal(wheels: list[str], jobs: int) -> list[list[str]]:
    """The wheels in `jobs` groups of about equal bytes: biggest first, each to the lightest group so
    far; downloads (no size known) in turn. Empty groups are left out."""
    groups: list[list[str]] = [[] for _ in range(jobs)]
    loads = [0] * jobs
    sized = sorted(((size(wheel), wheel) for wheel in wheels), reverse=True)
    for i, (nbytes, wheel) in enumerate(sized):
        k = loads.index(min(loads)) if nbytes else i % jobs
        groups[k].append(wheel)
        loads[k] += nbytes
    return [group for group in groups if group]


def tree_size(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):  # pip moved it meanwhile
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def site_packages() -> Path:
    """Where pip unpacks the wheels: this interpreter's venv."""
    return Path(sysconfig.get_paths()["purelib"])


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def wheels_line(wheels: list[str], to_write: int, jobs: int) -> tuple[str, tuple[float, float] | None]:
    """What an unpack step installs, in words, and its estimate (None: downloads only, no size known)."""
    local = sorted((size(w), Path(urlparse(w).path).name.split("-")[0].replace("_", "-")) for w in wheels)
    largest = ", ".join(name for n, name in reversed(local[-3:]) if n)
    downloads = sum(1 for n, _ in local if not n)
    what = f"{len(wheels)} wheels, {gb(to_write)} to write" + (f" (largest: {largest})" if largest else "")
    what += f", by {min(jobs, len(wheels))} pip(s) at once"
    what += f"; {downloads} more to download, whose time and size come on top" if downloads else ""
    low, high = ESTIMATES["write_per_gb"]
    return what, ((to_write / 1e9 * low, to_write / 1e9 * high) if to_write else None)


class Screen:
    """Each step on one line: its number, what it does, about how long it takes; then how long it took."""

    def __init__(self, steps: int) -> None:
        self.steps, self.step, self.began, self.open = steps, 0, 0.0, False

    def start(self, what: str, estimate_s: tuple[float, float] | None) -> None:
        self.step += 1
        if estimate_s is not None:
            low, high = (max(5, round(s / 5) * 5) for s in estimate_s)
            what += f" ({low}-{high} s on {MACHINE})" if low < high else f" (about {low} s on {MACHINE})"
        print(f"[{self.step}/{self.steps}] {what} ...", end="", flush=True)
        self.began, self.open = time.monotonic(), True

    def say(self, line: str) -> None:
        print(("\n" if self.open else "") + line, flush=True)
        self.open = False

    def end(self) -> None:
        took = f"{time.monotonic() - self.began:.0f} s"
        print(f" {took}" if self.open else f"      done in {took}", flush=True)
        self.open = False

    def fail(self, line: str) -> None:
        """The step failed: `line` says what and what to do."""
        print((" failed\n" if self.open else "") + line, flush=True)
        self.open = False


class Setup:
    """The steps, in order, with pip's output in one log."""

    def __init__(self, log_path: Path, log: IO[str], screen: Screen, jobs: int) -> None:
        self.log_path, self.log, self.screen, self.jobs = log_path, log, screen, jobs
        self.torch_from: str | None = None  # the torch wheel a plan installs: its URL
        self.missing: str | None = None  # a requirement a plan found nowhere (pip's "No matching distribution")

    def run(self, what: str, estimate_s: tuple[float, float], *args: str) -> bool:
        self.screen.start(what, estimate_s)
        self.log.flush()
        ok = subprocess.run(pip(*args), stdout=self.log, stderr=subprocess.STDOUT).returncode == 0
        return self.ended(ok, what)

    def plan(self, what: str, *args: str, advice: str = "") -> dict | None:
        """pip's report of what `pip install *args` would install; nothing is written. A requirement that
        no source holds is one line (with `advice`), not the log's tail."""
        self.screen.start(what, ESTIMATES["resolve"])
        done = subprocess.run(
            pip("install", "--dry-run", "--quiet", "--report", "-", *args), capture_output=True, text=True
        )
        self.log.write(done.stderr)
        missing = re.search(r"No matching distribution found for (\S+)", done.stderr)
        if done.returncode != 0 and missing is not None:  # one line, not the log's tail
            self.missing = missing[1]
            self.screen.fail(
                f"pip found no {self.missing} in the sources it was given (its log: {self.log_path}): {advice}"
            )
            return None
        if not self.ended(done.returncode == 0, what):
            return None
        report = json.loads(done.stdout)
        planned = planned_torch(report)
        if planned is not None:
            self.torch_from = planned[2]
        return report

    def unpack(self, report: dict | None) -> bool:
        """The report's wheels installed by `jobs` pips at once (False, too, where there is no report)."""
        if report is None:
            return False
        wheels = planned_wheels(report)
        local = sum(unpacked_size(w) for w in wheels)
        expected = local if all(size(w) for w in wheels) else 0  # a whole known only without downloads
        what, estimate_s = wheels_line(wheels, local, self.jobs) if wheels else ("no wheel to unpack", None)
        self.screen.start(what, estimate_s)
        site = site_packages()
        before = tree_size(site)

        def progress() -> None:
            written = gb(tree_size(site) - before)
            of = f"{written[:-3]} of about {gb(expected)}" if expected else written
            self.screen.say(f"      {time.monotonic() - self.screen.began:.0f} s: {of} written")

        self.log.flush()
        with tempfile.TemporaryDirectory() as tmp:
            procs = []
            for k, group in enumerate(deal(wheels, self.jobs)):
                listed = Path(tmp) / f"wheels-{k}.txt"
                listed.write_text("".join(f"{wheel}\n" for wheel in group))
                command = pip("install", "--no-deps", "--requirement", str(listed))
                procs.append(subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT))
            codes = wait(procs, progress, TICK_S)  # every pip ends before a failure is reported
        return self.ended(not any(codes), "unpacking the wheels")

    def ended(self, ok: bool, what: str) -> bool:
        self.log.flush()
        if ok:
            self.screen.end()
            return True
        tail = self.log_path.read_text(errors="replace").splitlines()[-20:]
        self.screen.say("\n".join([*tail, f"pip failed ({what}): the whole log is {self.log_path}"]))
        return False


def wait(procs: list[subprocess.Popen], tick: Callable[[], None], every_s: float) -> list[int]:
    """Every process's exit code once all have ended; `tick` runs every `every_s` seconds meanwhile."""
    due = time.monotonic() + every_s
    while any(proc.poll() is None for proc in procs):
        if time.monotonic() >= due:
            tick()
            due += every_s
        time.sleep(0.2)
    return [proc.returncode for proc in procs]


def install_cpu_torch(setup: Setup, index: str, reached: bool = True) -> bool:
    """TORCH=cpu's torch and torchvision, before the project (which then finds them installed). pip takes
    the highest version among every source it is configured with, so a CUDA build it would take from
    another is refused before anything is installed. reached=False: the index did not answer its probe,
    so pip tries it once, briefly, instead of retrying it for minutes."""
    once = [] if reached else ["--retries", "0", "--timeout", str(PROBE_S)]
    report = setup.plan("torch and torchvision, CPU-only: resolved", *cpu_torch(index), *once, advice=NO_CPU_WHEELS)
    if report is None:
        if setup.missing is None:  # else said with it
            print(NO_CPU_WHEELS)
        return False
    planned = planned_torch(report)
    if planned is not None and planned[1] != "cpu":
        version, build, url = planned
        print(
            f"TORCH=cpu: pip would take torch {version}, a {build.upper()} build, from {url} (a source pip is "
            f"configured with, besides {index}); nothing installed. {NO_CPU_WHEELS}"
        )
        return False
    return setup.unpack(report)


# Run by the venv's python in a new process: what a run imports, and one of torchvision's operators.
PAIR_CHECK = """
import json
from importlib import metadata
said = {"failed": "import torch", "torch": None, "torchvision": None}
try:
    said["torchvision"] = metadata.version("torchvision")
except metadata.PackageNotFoundError:
    pass
try:
    import torch
    said["torch"], said["failed"] = torch.__version__, "import torchvision"
    import torchvision
    said["failed"] = "torchvision.ops.nms"
    boxes = torch.tensor([[0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 2.0, 1.9]])
    torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8]), 0.5)
    said["failed"] = None
except Exception as err:
    text = str(err).strip()
    said["error"] = type(err).__name__ + (": " + text.splitlines()[0] if text else "")
print(json.dumps(said))
"""


def check_pair(python: str, fix_source: list[str], command: str) -> str | None:
    """Whether torch and torchvision work together in `python`: None, or the one line that says what
    failed and the command that fixes it (fix_source: pip's arguments for where torch came from)."""
    done = subprocess.run([python, "-c", PAIR_CHECK], capture_output=True, text=True)
    venv = os.path.relpath(Path(python).parents[1])
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit code {done.returncode}"
        tail = done.stderr.strip().splitlines()[-1:] or ["nothing on stderr"]
        return (
            f"the check of torch and torchvision ended with {how} ({tail[0]}): `rm -rf {venv} && "
            f"{command}` sets the venv up again"
        )
    said = json.loads(lines[-1])
    if said["failed"] is None:
        return None
    torch, vision = said["torch"], said["torchvision"]
    pair = f"torch {torch or '(not importable)'}, torchvision {vision or '(not installed)'}"
    if torch is None:
        fix = f"`rm -rf {venv} && {command}` sets the venv up again"
    elif release(torch) < TORCH_FLOOR:  # only a torch from outside the set-up (PYTHONPATH) can be this old
        fix = f"the lab needs {TORCH}: `rm -rf {venv} && {command}` sets the venv up again"
    else:
        wanted = matching_torchvision(torch)
        args = " ".join(dict.fromkeys(["--force-reinstall", "--no-deps", f"'{wanted}'", *fix_source]))  # each once
        fix = f"`{python} -m pip install {args}` installs the torchvision built for torch {torch}"
    return f"torch and torchvision do not work together: {said['failed']} failed with {said['error']} ({pair}): {fix}"


def matching_torchvision(torch_version: str) -> str:
    """The torchvision requirement built for a torch release: 0.(minor + 15) for torch 2.x (2.14: 0.29)."""
    numbers = (*release(torch_version), 0, 0)
    return f"torchvision==0.{numbers[1] + 15}.*" if numbers[0] == 2 else "torchvision"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=2, help="pips unpacking wheels at once (default: 2)")
    parser.add_argument("--log", type=Path, help="pip's own output (default: pip.log in the venv)")
    parser.add_argument("--stamp", type=Path, help="written when all went well: torch=<build> <version>")
    parser.add_argument("--torch-index", help="TORCH=cpu: the CPU-only torch from this index URL or wheel folder")
    parser.add_argument("--command", help="the make command, named in hints (default: make setup [TORCH=cpu])")
    parser.add_argument("--check", action="store_true", help="only check that torch and torchvision work together")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs} is invalid: accepted: an integer >= 1")
    command = args.command or ("make setup TORCH=cpu" if args.torch_index is not None else "make setup")
    fix_source = torch_source(args.torch_index) if args.torch_index is not None else []
    venv, held = os.path.relpath(sys.prefix), installed_torch()
    if args.check:
        failed = check_pair(sys.executable, fix_source, command)
        print(failed or f"torch and torchvision work together in {venv}: both import, and torchvision.ops.nms runs")
        return 1 if failed else 0
    if args.torch_index is not None and held is not None and held[1] != "cpu":
        print(
            f"{venv} holds torch {held[0]}, the {held[1].upper()} build, which pip does not swap for the CPU-only "
            f"one in place: `rm -rf {venv} && {command}` deletes {venv}, with anything you installed into "
            "it, and sets it up again with the CPU-only torch"
        )
        return 2
    older = held is not None and release(held[0]) < TORCH_FLOOR
    cpu_steps = args.torch_index is not None and (held is None or older)
    reached = True
    if cpu_steps and not Path(args.torch_index).expanduser().is_dir():
        why = probe(args.torch_index)
        if why is not None:  # said now, not after pip's minutes of silent retries
            reached = False
            print(unreachable(args.torch_index, why, pip_sources()), flush=True)
    log_path = args.log or Path(venv) / "pip.log"
    if held is not None and not older:
        torch = f"its torch {held[0]} ({held[1]}) kept"
    else:
        where = (args.torch_index if reached else "pip's other sources") if args.torch_index is not None else None
        torch = f"a CPU-only {TORCH} from {where}" if where else f"pip's default {TORCH}"
        torch += f", in place of its torch {held[0]}" if held is not None else ""
    print(f"setting up {venv} with {torch}; pip's own output goes to {log_path}", flush=True)
    begun = time.monotonic()
    with open(log_path, "w") as log:
        setup = Setup(log_path, log, Screen(5 + 2 * cpu_steps), args.jobs)
        if not (
            setup.run("pip, upgraded", ESTIMATES["upgrade"], "install", "--upgrade", "pip")
            and (not cpu_steps or install_cpu_torch(setup, args.torch_index, reached))
            and setup.unpack(setup.plan(f"what '{PROJECT}' needs: resolved", "-e", PROJECT, advice=WHERE_PIP_LOOKS))
            and setup.run(
                "the project, editable (pip checks each requirement's version)",
                ESTIMATES["editable"],
                *("install", "-e", PROJECT),
            )
        ):
            return 1
        setup.screen.start("torch and torchvision: imported, and torchvision's nms run", ESTIMATES["check"])
        failed = check_pair(sys.executable, fix_source, command)
        if failed is not None:
            setup.screen.fail(failed)
            return 1
        setup.screen.end()
    held = installed_torch()
    torch = f"torch {held[0]} ({held[1]})" if held else "no torch"
    if args.torch_index is not None and (held is None or held[1] != "cpu"):
        print(f"TORCH=cpu, but the set-up ended with {torch}: {NO_CPU_WHEELS}")
        return 1
    if args.stamp is not None:
        args.stamp.write_text(f"torch={held[1]} {held[0]}\n" if held else "torch=none\n")
    came = f"from {shown(setup.torch_from)}" if setup.torch_from else "already installed, kept"
    print(f"set up in {time.monotonic() - begun:.0f} s: {venv} with {torch}, {came}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
