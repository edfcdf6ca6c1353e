"""Networks to predict on: named presets (trainer/links.py), `alpha_us,beta_GBps`, or alpha and beta
fitted to the collective benchmark's collectives.json (python -m trainer.tools.collectives)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from trainer.errors import ConfigError
from trainer.links import KINDS, PRESETS, Link, Network


def parse_network(text: str) -> Network:
    """A preset's name, or `alpha_us,beta_GBps` for one link used by every collective."""
    if text in PRESETS:
        return PRESETS[text]
    parts = text.split(",")
    try:
        alpha_us, beta_gbps = (float(p) for p in parts)
        return Network.uniform(f"alpha={alpha_us:g}us,beta={beta_gbps:g}GB/s", alpha_us * 1e-6, beta_gbps * 1e9)
    except ValueError:
        pass
    raise ConfigError(
        f"network {text!r} is neither a preset ({', '.join(PRESETS)}) nor `alpha_us,beta_GBps` with "
        "alpha >= 0 and beta > 0 (e.g. 5,45)"
    )


def fit_link(kind: str, sizes: Sequence[float], seconds: Sequence[float], world_size: int) -> Link:
    """alpha and beta of one collective from timings at world_size ranks, by least squares on the
    relative error: small messages pin alpha, large ones beta, neither swamps the other.

    The model t = k alpha + (k / n) S / beta, with k ring steps (2(n-1) or n-1), is linear in
    (alpha, 1/beta); each equation is divided by its measured t.
    """
    if world_size < 2:
        raise ConfigError(f"a collective benchmark at world size {world_size} measured no communication: use 2+ ranks")
    if len(sizes) < 2 or len(sizes) != len(seconds) or min(seconds) <= 0:
        raise ConfigError(f"{kind}: need timings (> 0 s) at 2 or more sizes to fit alpha and beta, got {len(sizes)}")
    k = 2 * (world_size - 1) if kind == "all_reduce" else world_size - 1
    rows = [(k / t, k * s / (world_size * t)) for s, t in zip(sizes, seconds, strict=True)]
    # Normal equations of min sum (a x_a + b x_b - 1)^2, a = alpha, b = 1 / beta.
    aa = sum(x * x for x, _ in rows)
    ab = sum(x * y for x, y in rows)
    bb = sum(y * y for _, y in rows)
    ra, rb = sum(x for x, _ in rows), sum(y for _, y in rows)
    det = aa * bb - ab * ab
    alpha, inv_beta = (ra * bb - rb * ab) / det, (aa * rb - ab * ra) / det
    if alpha < 0:  # latency too small to resolve: the bandwidth term alone, alpha = 0
        alpha, inv_beta = 0.0, rb / bb
    if inv_beta <= 0:
        raise ConfigError(f"{kind}: timings do not grow with size, so no bandwidth fits them; sweep larger sizes")
    return Link(alpha_s=alpha, beta_Bps=1.0 / inv_beta)


def fit_network(path: Path) -> Network:
    """A Network fitted per collective kind to a collectives.json."""
    try:
        data = json.loads(path.read_text())
        world_size, results = int(data["world_size"]), data["results"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--collectives {path}: not a collective benchmark's collectives.json ({err})") from err
    links = {}
    for kind in KINDS:
        rows = [r for r in results if r.get("op") == kind]
        links[kind] = fit_link(kind, [r["size_bytes"] for r in rows], [r["seconds"] for r in rows], world_size)
    return Network(f"fit of {path}", links)
