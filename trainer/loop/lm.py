"""A language model's rows: tokens per second and model FLOPs utilisation (MFU).

MFU is the model's training FLOPs per token (6 x non-embedding parameters + the attention term
12 L d T, as nanoGPT and the PaLM paper count them) times the tokens this rank trained per second,
over its device's peak. The peak is trainer.peak_tflops, or on CUDA a known GPU's bf16 dense peak;
on anything else the row leaves MFU out rather than invent a peak.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from data.base import DataModule
from data.tokens import decode, encode
from models.generate import generate
from trainer.core import DistContext, TrainSettings

# bf16 dense tensor-core peaks from the vendors' data sheets (TFLOP/s), matched by device name.
CUDA_PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0))


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """trainer.peak_tflops if set; else the table's entry for this CUDA device; else None."""
    if configured is not None:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in CUDA_PEAK_TFLOPS if key in name), None)


@dataclass(frozen=True)
class TokenRates:
    """What a rank needs to turn trained tokens and seconds into its LM rows."""

    flops_per_token: float | None  # None: the model does not say (only the token rate is logged)
    peak_flops: float | None  # per second, this rank's device

    def row(self, tokens: int, seconds: float) -> dict[str, float]:
        rate = tokens / seconds if seconds > 0 else 0.0
        row = {"throughput/tokens_per_s": rate}
        if self.flops_per_token is not None and self.peak_flops:
            row["perf/mfu"] = rate * self.flops_per_token / self.peak_flops
        return row


def token_rates(model: nn.Module, data: DataModule, device: torch.device, settings: TrainSettings) -> TokenRates | None:
    """Token data gets LM rows; MFU only where the model counts its FLOPs and the peak is known."""
    if not data.tokens:
        return None
    count = getattr(model, "flops_per_token", None)
    peak = peak_tflops(device, settings.peak_tflops)
    return TokenRates(count() if callable(count) else None, peak * 1e12 if peak else None)


def compiler_missing(device: torch.device) -> str | None:
    """Why torch.compile cannot run here, or None: on CPU, inductor builds C++ kernels with a compiler."""
    if device.type != "cpu":
        return None
    names = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if any(name and shutil.which(name) for name in names):
        return None
    return "torch.compile on CPU builds C++ kernels, and no C++ compiler was found on PATH (g++, c++, clang++, $CXX)"


def compile_model(model: nn.Module) -> None:
    """torch.compile the model in place (nn.Module.compile): parameters and state_dict keys stay the
    model's own, so the strategies, checkpoints and evaluation see the same module."""
    model.compile()


def write_vocab(ctx: DistContext, run_dir: Path, vocab: dict[str, object] | None) -> None:
    """Rank 0: <run dir>/vocab.json, so the run's tokens can be read without the corpus."""
    if vocab is not None and ctx.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "vocab.json").write_text(json.dumps(vocab) + "\n", encoding="utf-8")


def end_of_run_sample(model: nn.Module, data: DataModule, tokens: int = 120) -> str | None:
    """A short greedy-free sample (temperature 0.8, top-k 40, seed 0), the same on every rank; None
    for data without a vocabulary or for tokens=0. Every rank must call it: a sharded model's forward
    communicates."""
    vocab = data.vocabulary()
    if vocab is None or tokens == 0:
        return None
    prompt = encode("\n", vocab) if "\n" in str(vocab.get("chars", "\n")) else [0]
    # Eager even under trainer.compile: the context grows a token at a time, and torch.compile would
    # build new inference graphs for it (one length, then dynamic ones), which cost far more than the
    # forwards of one short sample they would speed up.
    with torch.compiler.set_stance("force_eager"):
        ids = generate(model, prompt, tokens, temperature=0.8, top_k=40, seed=0)
    return decode(ids, vocab)
