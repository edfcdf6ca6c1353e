"""python -m trainer.scaling --run DIR [--collectives JSON] --ranks 2,8,64,512 [--network NAME|alpha_us,beta_GBps]
[--intra-network ...] [--gpus-per-node 8] [--json PATH] [--plot PATH]: see trainer/scaling/__init__.py."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from trainer.comm_schedule import Schedule
from trainer.errors import ConfigError
from trainer.links import PRESETS, Topology
from trainer.scaling.caps import cap_advice, logged_step_s, noise_warning
from trainer.scaling.networks import fit_network, parse_network
from trainer.scaling.predict import FSDP_WRAPS, predict
from trainer.scaling.profile import RunProfile, read_profile

CAPS_OF = "ddp"  # the strategy whose sync.bucket_cap_mb --bucket-caps chooses


def _numbers(text: str, flag: str, *, whole: bool = False) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) <= 0 or (whole and any(v != int(v) for v in values)):
        kind = "integers" if whole else "numbers"
        raise ConfigError(f"{flag}={text!r} is invalid: a comma-separated list of {kind} > 0")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished run's directory (1 rank, sync=none best)")
    parser.add_argument("--collectives", type=Path, help="fit alpha and beta to this collectives.json instead")
    parser.add_argument("--ranks", default="2,8,64,512", help="comma-separated N to predict (default 2,8,64,512)")
    parser.add_argument(
        "--network", default="loopback", help=f"between nodes: {', '.join(PRESETS)} or alpha_us,beta_GBps"
    )
    parser.add_argument("--intra-network", help="inside a node (default: --network, i.e. one flat network)")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="ranks per node (default 8): the node hierarchical and hsdp split over, and where a ring crosses nodes",
    )
    parser.add_argument("--strategies", help="comma-separated options of conf/sync/ (default: all of them)")
    parser.add_argument(
        "--fsdp-wrap",
        choices=FSDP_WRAPS,
        help="the units of sync=fsdp (and of every strategy that gathers units), as sync.wrap makes them: block "
        "(one per nn.ModuleList element, the rest in the root), module (one per module owning parameters), auto "
        "(block if the run recorded blocks); default: each strategy's own sync.wrap",
    )
    parser.add_argument("--bucket-caps", default="0.25,1,5,25,100", help="sync=ddp caps (MiB) to choose among")
    parser.add_argument(
        "--compute-ms", type=float, help="what if a step's compute took this long (on a GPU, say); phases keep shares"
    )
    parser.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="communication hides under no compute (CPU ranks filling the cores; default: it overlaps as on GPUs)",
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--plot", type=Path, help="efficiency against N (default: <run>/scaling.png)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _topologies(args: argparse.Namespace) -> list[Topology]:
    ranks = [int(n) for n in _numbers(args.ranks, "--ranks", whole=True)]
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node={args.gpus_per_node} is invalid: it must be >= 1")
    inter = fit_network(args.collectives) if args.collectives else parse_network(args.network)
    intra = parse_network(args.intra_network) if args.intra_network else inter
    try:
        return [Topology(n, args.gpus_per_node, intra, inter) for n in ranks]
    except ValueError as err:
        raise ConfigError(f"--ranks={args.ranks} with --gpus-per-node={args.gpus_per_node}: {err}") from err


def _profile(args: argparse.Namespace, described: dict[str, Schedule]) -> RunProfile:
    measured = read_profile(args.run, {name for name, s in described.items() if s.optimizer_shard is not None})
    source = f"measured on {measured.device}"
    if args.compute_ms is not None:
        source = f"--compute-ms; {measured.compute_s * 1e3:.3f} ms measured on {measured.device}"
        measured = measured.with_compute(args.compute_ms / 1e3)
    print(
        f"run {args.run}: {measured.gradient_bytes / 2**20:.2f} MiB of gradients in {len(measured.tensors)} "
        f"tensors, compute {measured.compute_s * 1e3:.3f} ms per step at batch {measured.batch_per_rank} per rank "
        f"({source})"
    )
    if note := measured.caveat():
        print(f"note: {note}")
    if warning := noise_warning(logged_step_s(args.run)):
        print(warning)
    return measured


def _chosen(
    args: argparse.Namespace, described: dict[str, Schedule], silent: list[str]
) -> tuple[dict[str, Schedule], list[str]]:
    """The strategies --strategies names (default: every option, as `schedules` orders them), each
    with what its step sends (--fsdp-wrap's units); and those left out, which do not say it."""
    options = [*described, *silent]
    names = args.strategies.split(",") if args.strategies else options
    unknown = [s for s in names if s not in options]
    if unknown:
        raise ConfigError(f"--strategies: unknown {', '.join(unknown)}; accepted: {', '.join(options)}")
    wrap = args.fsdp_wrap
    chosen = {name: described[name].with_wrap(wrap) if wrap else described[name] for name in names if name in described}
    left_out = [name for name in names if name in silent]
    if not chosen:
        raise ConfigError(f"--strategies={args.strategies}: none of them says what its step sends (schedule())")
    return chosen, left_out


def run(args: argparse.Namespace) -> int:
    # Imported once the command line is read: building the strategies brings torch, the plot
    # matplotlib (--help and a bad flag answer without either).
    from trainer.scaling import report
    from trainer.scaling.options import schedules

    described, silent = schedules()
    chosen, left_out = _chosen(args, described, silent)
    caps = _numbers(args.bucket_caps, "--bucket-caps")
    topologies = _topologies(args)
    profile = _profile(args, described)
    intra, inter = topologies[0].intra, topologies[0].inter
    where = inter.describe() if intra == inter else f"{inter.describe()} between nodes, {intra.describe()} inside"
    overlap = "communication overlaps compute" if args.overlap else "no overlap: every collective is exposed"
    print(f"network: {where}; {args.gpus_per_node} ranks per node (--gpus-per-node); {overlap}")
    predictions = [
        predict(profile, topo, name, schedule, overlap=args.overlap)
        for name, schedule in chosen.items()
        for topo in topologies
    ]
    print(report.format_table(predictions))
    if note := report.above_one_note(predictions):
        print(note)
    if left_out:
        names = ", ".join(f"sync={s}" for s in left_out)
        print(f"note: not predicted: {names}, which does not say what its step sends (SyncStrategy.schedule)")
    advice, best = cap_advice(profile, topologies, CAPS_OF, described[CAPS_OF], caps, overlap=args.overlap)
    print(advice)
    meta = {
        "run": str(args.run),
        "network": inter.describe(),
        "intra_network": intra.describe(),
        "gpus_per_node": args.gpus_per_node,
        "overlap": args.overlap,
        "compute_s": profile.compute_s,
        "gradient_bytes": profile.gradient_bytes,
        "best_bucket_cap_mb": None if best is None else {str(b.ranks): b.bucket_cap_mb for b in best},
    }
    if args.json:
        report.write_json(args.json, predictions, meta)
        print(f"wrote {args.json}")
    plot_path = args.plot or args.run / "scaling.png"
    report.plot(predictions, f"{args.run.name}: {where}", plot_path)
    print(f"wrote {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
