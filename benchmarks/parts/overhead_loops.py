"""The two implementations the overhead benchmark times side by side, a hand-written loop and
ddplab's Trainer, and the models they train.

Shared by the sections of benchmarks/overhead.py (each section's rounds and table are its own
module) and benchmarks/nanogpt_recipe.py.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

from data.text import Windows
from trainer.logger.jsonl import JsonlLogger
from trainer.setup import dist as ddist
from trainer.setup.build import build_parts, build_trainer, prepare_data
from trainer.setup.config import compose_config

MODELS = {
    "mlp-25M": ["model=mlp", "model.hidden_sizes=[3584,3584,3584]", "data=synthetic", "data.batch_size=64"],
    "cnn": ["model=cnn", "data=fake", "data.batch_size=64", "data.num_samples=4096"],
    # A step of well under a millisecond, where per-step bookkeeping shows.
    "mlp-tiny": ["model=mlp", "model.hidden_sizes=[64]", "data=synthetic", "data.batch_size=64"],
    # Where an optimisation of communication could lose. A few huge tensors (17 M parameters, 64 MiB
    # of them in one 4096x4096 weight, larger than any bucket): bucketing and splitting have little to group.
    "mlp-wide": ["model=mlp", "model.hidden_sizes=[4096,4096]", "data=synthetic", "data.batch_size=64"],
    # A transformer with a tied head (nanoGPT's shape, 0.8 M parameters, 52 gradient tensors) on
    # char-level text: the loop fetches windows as nanoGPT's get_batch does, one gather per batch.
    "gpt": [
        "model=gpt",
        "model.n_layer=4",
        "model.n_head=4",
        "model.n_embd=128",
        "model.block_size=64",
        "data=text",
        "data.batch_size=16",
    ],
    # Many small tensors (50 hidden layers of 64: 102 gradient tensors, 0.2 M parameters): per-tensor
    # and per-bucket overheads dominate.
    "mlp-deep": ["model=mlp", f"model.hidden_sizes=[{','.join(['64'] * 50)}]", "data=synthetic", "data.batch_size=64"],
}


class HandWritten:
    """The loop a DDP tutorial writes: same model, data, batch and optimizer; nothing else.

    Strategies map to what the tutorial would use: none and manual as named (manual all-reduces each
    gradient, whatever the knobs), ddp and bucketed to PyTorch's DistributedDataParallel, zero to
    DDP with torch's ZeroRedundancyOptimizer (its optimizer-state sharding: all_reduce, then each
    rank steps its share of the parameters and broadcasts them), fsdp and zero:stage=3 to
    fully_shard on each transformer block (or, without blocks, each layer that owns parameters),
    then the root.
    """

    def __init__(self, overrides: list[str], strategy: str, ctx: ddist.DistContext, log_every: int = 0) -> None:
        """log_every > 0: every n steps the loss is all-reduced and read on the host, as torchtitan's
        loop logs a row (its loss averaged over the ranks, one host sync); 0: nothing logged."""
        self.log_every, self.step, self.logged = log_every, 0, 0.0
        cfg = compose_config(overrides)
        parts = build_parts(cfg)  # the same model and dataset objects
        prepare_data(parts.data, ctx)  # data=text: rank 0 writes the token file the windows map
        train, _ = parts.data.build_datasets()
        if isinstance(train, Windows):  # nanoGPT's get_batch: one gather of whole windows from the token file
            self.fetch: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = lambda i: train.batch(i.numpy())
        else:
            assert isinstance(train, TensorDataset), "the benchmark's datasets are in memory"
            self.fetch = lambda index: tuple(t[index] for t in train.tensors)
        self.sampler: DistributedSampler[int] = DistributedSampler(
            train, ctx.world_size, ctx.rank, shuffle=True, seed=0, drop_last=True
        )
        self.loader = BatchSampler(self.sampler, batch_size=parts.data.batch_size, drop_last=True)
        # The tutorial loop has no knobs (manual is one call per gradient); ZeRO stage 3 written as
        # PyTorch's tutorials write it is FSDP2.
        strategy = "fsdp" if strategy.startswith("zero:") and "stage=3" in strategy else strategy.split(":")[0]
        self.device, self.world_size, self.manual = ctx.device, ctx.world_size, strategy == "manual"
        model = parts.model.to(ctx.device)
        if strategy in ("ddp", "bucketed", "zero"):  # bucketed (DDP built by hand) is measured against PyTorch's DDP
            model = DistributedDataParallel(model, bucket_cap_mb=25)
        if strategy == "fsdp":
            # As FSDP2's tutorials write it: a transformer's blocks (the elements of its
            # nn.ModuleList) one unit each; another model, each module owning parameters. A
            # parameter two modules share (the gpt's head tied to its embedding) stays in the root.
            blocks = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]
            owners: dict[int, int] = {}
            for layer in model.modules():
                for param in layer.parameters(recurse=False):
                    owners[id(param)] = owners.get(id(param), 0) + 1
            for layer in blocks or list(model.modules()):
                own = list(layer.parameters(recurse=bool(blocks)))  # a block's are its submodules'
                if layer is not model and own and all(owners[id(p)] == 1 for p in own):
                    fully_shard(layer)
            fully_shard(model)
        if self.manual:
            for tensor in model.parameters():
                dist.broadcast(tensor.data, src=0)
        self.model = model
        if strategy == "zero":
            self.optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9
            )
        else:
            self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        self.epoch, self.batches = 0, iter(self.loader)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            try:
                indices = next(self.batches)
            except StopIteration:
                self.epoch += 1
                self.sampler.set_epoch(self.epoch)
                self.batches = iter(self.loader)
                indices = next(self.batches)
            index = torch.as_tensor(indices)
            inputs, targets = (t.to(self.device, non_blocking=True) for t in self.fetch(index))
            self.optimizer.zero_grad(set_to_none=True)
            logits = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())  # per token for the gpt
            loss.backward()
            if self.manual:
                for grad in (p.grad for p in self.model.parameters() if p.grad is not None):
                    dist.all_reduce(grad)
                    grad.div_(self.world_size)
            self.optimizer.step()
            self.step += 1
            if self.log_every and self.step % self.log_every == 0:  # torchtitan's row: the global mean loss
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                self.logged = mean.item() / self.world_size


class Framework:
    """ddplab's own Trainer, built as train.py builds it, logging JSONL every 10 steps."""

    def __init__(
        self, overrides: list[str], strategy: str, ctx: ddist.DistContext, out: Path, extra: Sequence[str] = ()
    ) -> None:
        name, *knobs = strategy.split(":")  # e.g. "manual:coalesce_mb=25" -> sync=manual sync.coalesce_mb=25
        sync = [f"sync={name}", *(f"sync.{knob}" for knob in knobs)]
        cfg = compose_config(
            [
                *overrides,
                *sync,
                "logger=none",
                "trainer.max_steps=1000000000",
                "trainer.eval_every_n_steps=0",
                "trainer.progress_bar=false",
                *extra,  # the benchmark's --set: after the defaults above, so that it can change them
            ]
        )
        parts = build_parts(cfg)
        prepare_data(parts.data, ctx)
        self.jsonl = out / f"rank{ctx.rank}.jsonl"
        self.trainer = build_trainer(parts, ctx, [JsonlLogger(self.jsonl)], out, {})

    def run(self, steps: int) -> None:
        self.trainer.train(self.trainer.step + steps)

    def _backward(self) -> None:
        """One batch's forward and backward, outside the loop: the loss as the step computes it
        (logits flattened over positions, so a gpt's [batch, time, vocab] works as a classifier's)."""
        trainer = self.trainer
        inputs, targets = next(iter(trainer.train_loader))
        logits = trainer.train_model(inputs.to(trainer.ctx.device))
        F.cross_entropy(logits.flatten(0, -2), targets.to(trainer.ctx.device).flatten()).backward()

    def sync_alone(self, repeats: int) -> float:
        """Median seconds of after_backward on real gradients with the ranks started together.

        In training, the sync phase also holds the wait for the slower rank to finish its
        backward; started after a barrier, it is the strategy's communication alone.
        """
        trainer = self.trainer
        times = []
        for _ in range(repeats):
            self._backward()  # each sync its own backward: a later step's gradients are checked as they come
            dist.barrier()
            started = time.perf_counter()
            trainer.sync.after_backward(trainer.train_model)
            times.append(time.perf_counter() - started)
        trainer.sync.zero_grad(trainer.optimizer)  # flat-buffer strategies keep their views
        return statistics.median(times)

    def gradient_mb(self) -> float:
        """MiB of gradient tensors this rank holds right after after_backward, from the tensors themselves:
        each distinct storage behind a model parameter's or an optimizer parameter's .grad (so a flat
        buffer counts once, padding included; DDP's own reducer buckets, not a .grad, are not seen)."""
        trainer = self.trainer
        self._backward()
        trainer.sync.after_backward(trainer.train_model)
        params = [*trainer.model.parameters(), *(p for g in trainer.optimizer.param_groups for p in g["params"])]
        grads = [p.grad for p in params if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # fsdp: this rank's DTensor shard
        held = {s.data_ptr(): s.nbytes() for s in (g.untyped_storage() for g in local)}
        trainer.sync.zero_grad(trainer.optimizer)
        return sum(held.values()) / 2**20

    def comm(self, skip_rows: int) -> tuple[float, float, float]:
        """Median communication and exposed seconds, and bytes, per step over this rank's rows after warm-up
        (the observer's sampled steps: trainer/measures.py's definitions)."""
        rows = [json.loads(line) for line in self.jsonl.read_text().splitlines()][skip_rows:]
        rows = [row for row in rows if "comm/bytes_per_step" in row]
        if not rows:
            return 0.0, 0.0, 0.0
        timed = [row for row in rows if "time/comm_s" in row]
        seconds = statistics.median(r["time/comm_s"] for r in timed) if timed else 0.0
        exposed = statistics.median(r["time/comm_exposed_s"] for r in timed) if timed else 0.0
        return seconds, exposed, rows[-1]["comm/bytes_per_step"]
