"""Every quantity the lab measures, defined once: the same formula for every strategy.

docs/metrics.md says each definition in prose, and every row key in docs/outputs.md links there.
The observer (trainer/observer.py) takes the raw facts on the sampled step (a collective's kind,
size and group, the instants of its life, the step's phase marks, memory per kind); the functions
here turn them into the numbers of a row. Nothing else computes a row's time, bytes or overlap.

- The sampled step: 1 step in `trainer.sample_every_n_steps`, the one before each row by default;
  the same step for every quantity and every strategy. Other steps are not watched at all.
- Bytes (`comm/bytes_per_step`): what this rank puts on the wire, from the collective's kind, the
  bytes of its buffer S and the ranks n of the group it runs on, as a ring moves them: S times
  trainer/comm_math.py's wire factor (all_reduce 2(n-1)/n; reduce_scatter, all_gather and
  broadcast (n-1)/n). Control collectives (agreements of a
  few bytes: a flag per parameter, the cap tuner's vote, a gradient norm) count apart
  (`comm/control_bytes_per_step`), never in the gradient and parameter traffic.
- Bytes across nodes (`comm/inter_node_bytes_per_step`, network=<preset> with network.gpus_per_node
  > 1): the same bytes, of the data collectives whose group spans more than one emulated node (a
  flat ring of every rank does; a group inside one node does not): what this rank's traffic puts
  on the slow link between nodes.
- Communication time (`time/comm_s`): the length of the union of the intervals from each
  collective's launch to its completion as the backend reports it (gloo's thread, the NCCL
  stream's event; on an emulated link, when the link hands it on); gaps between collectives are
  not communication.
- Exposed (`time/comm_exposed_s`): the length of the union of the intervals in which the training
  thread waited for a collective: from when it asked for the result (its wait(); for collectives
  torch waits for inside backward, DDP's buckets, the end of backward's computation: the last
  one's launch) until the result was there. Never more than the communication time.
- Overlap (`comm/overlap_fraction`): 1 - exposed / communication time.
- Bus bandwidth (`comm/busbw_GBps`): nccl-tests' busbw over the step, the sum of each data
  collective's S times its bus factor (trainer/comm_math.py: the wire factor but for a broadcast's
  1), over the communication time: comparable with a link's speed whatever the kind.
- The link's ideal (`time/comm_exposed_link_s`, network=<preset>): what the step would have waited
  for if only the emulated link cost time. The step is replayed: its compute keeps its length, each
  wait of the training thread takes only what the link would have made it wait, and whatever came
  after a wait (later launches, later waits) moves earlier by what the wait saved; the link carries
  one collective at a time, each for its link time from its (replayed) launch. Waits the training
  thread makes back to back (bucketed's after backward) and the one torch makes for all of DDP's
  buckets at the end of backward are then measured from the same instants.
- Phases (`time/<phase>_s`, `time/step_s`): the sampled step's own intervals between the loop's
  marks; they add up to the step.
- Memory (`memory/<kind>_mb`, `memory/<kind>_peak_mb`, `memory/peak_mb`): the bytes of the
  storages this rank holds, each storage once, by kind (MEMORY_KINDS): parameters (the model's, a
  DTensor's local shard, and the optimizer's own where it steps a shard; where a strategy gathers
  units, zero stage 3 and fsdp, only the shard), gradients (the .grad of the model's and the
  optimizer's parameters, and the full gradients a strategy holds outside them: fsdp's unsharded
  ones in backward), optimizer state (every tensor of its state), communication buffers (what a
  strategy allocates to communicate beyond those: DDP's reducer buckets, zero's gradient buckets
  being reduced, gathered units' full parameters), activations (what autograd saved for backward
  in the step's forward and loss, parameters' own storages left out; the most of any
  micro-batch). Held: parameters and optimizer state as the sampled step ends, gradients and
  communication buffers as its sync phase ends (averaged, before the optimizer uses them),
  activations as the forward ends (the peak of the micro-batches); peak: the most at any probe of
  the sampled step (the ends of its backward, sync and optimizer phases, each
  collective's launch and the end of each wait for one). The step's total (`memory/peak_mb`): on
  CUDA the allocator's own peak over the sampled step; elsewhere, with no allocator statistics,
  the sum of the kinds' peaks: an upper bound on what these kinds held at once (temporaries
  between probes are not seen).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainer.comm_math import KINDS, bus_factor, busy_time, overlap_fraction, wire_factor

PHASES = ("data", "forward", "backward", "sync", "optimizer")  # the loop's marks, in a step's order
MEMORY_KINDS = ("parameters", "gradients", "optimizer_state", "comm_buffers", "activations")
MIB = 2**20


def wire_bytes(kind: str, nbytes: int, ranks: int) -> float:
    """Bytes this rank puts on the wire for one collective of `kind` on a buffer of `nbytes`."""
    return wire_factor(kind, ranks) * nbytes


@dataclass
class Collective:
    """One collective of the sampled step, its instants in seconds from the step's start."""

    kind: str
    nbytes: int  # its buffer: the full input of a reduce_scatter, the full output of an all_gather
    ranks: int  # the size of the group it ran on
    control: bool  # an agreement of a few bytes, counted apart
    launched: float
    completed: float  # the backend's completion (or, where it reports none, the end of the wait)
    needed: float  # when the training thread asked for the result
    link_s: float = 0.0  # its time on the emulated link (0: none)
    calls: int = 1  # collectives of `kind` sharing these instants and `nbytes` (a PowerSGD hook's three)
    resumed: float | None = None  # when the training thread went on after waiting for it (None: completed)
    across_nodes: bool | None = None  # its group spans emulated nodes (None: the link has no nodes)


def comm_time(collectives: Sequence[Collective]) -> float:
    """time/comm_s: the union of [launched, completed] over the data collectives."""
    return busy_time((c.launched, max(c.launched, c.completed)) for c in collectives if not c.control)


def exposed_time(collectives: Sequence[Collective]) -> float:
    """time/comm_exposed_s: the union of [needed, completed] over the data collectives, where the
    training thread asked before the result was there."""
    return busy_time((c.needed, c.completed) for c in collectives if not c.control and c.completed > c.needed)


def link_ideal(collectives: Sequence[Collective]) -> float:
    """time/comm_exposed_link_s: the step replayed with only the link's time (module docstring).

    A wait is one instant `needed` and everything asked for there (torch's one wait for DDP's
    buckets is one); it ends when the last of them is back. Launches and waits are replayed in the
    order they happened, each moved earlier by what the waits before it saved."""
    data = [c for c in collectives if not c.control]
    waits: dict[float, list[Collective]] = {}
    for c in data:
        waits.setdefault(c.needed, []).append(c)
    events = sorted([(c.launched, 0, i) for i, c in enumerate(data)] + [(at, 1, -1) for at in waits])
    done: dict[int, float] = {}
    shift = free = exposed = 0.0  # how much earlier the replay is; when the link is free; the ideal wait
    for at, is_wait, index in events:
        if not is_wait:
            c = data[index]
            free = max(at - shift, free) + c.link_s
            done[id(c)] = free
            continue
        group = waits[at]
        real = max(0.0, max(c.resumed if c.resumed is not None else c.completed for c in group) - at)
        ideal = max(0.0, max(done[id(c)] for c in group) - (at - shift))
        exposed += ideal
        shift += real - ideal
    return exposed


def comm_row(collectives: Sequence[Collective], emulated: bool) -> dict[str, float]:
    """A sampled step's comm/* and time/comm* keys (none when it sent nothing)."""
    if not collectives:
        return {}
    data = [c for c in collectives if not c.control]
    control = [c for c in collectives if c.control]
    row: dict[str, float] = {}
    if control:
        row["comm/control_bytes_per_step"] = sum(wire_bytes(c.kind, c.nbytes, c.ranks) for c in control)
        row["comm/control_collectives_per_step"] = sum(c.calls for c in control)
    if not data:
        return row
    total = 0.0
    for kind in KINDS:
        of_kind = [c for c in data if c.kind == kind]
        if of_kind:
            sent = sum(wire_bytes(kind, c.nbytes, c.ranks) for c in of_kind)
            row[f"comm/{kind}_bytes_per_step"] = sent
            row[f"comm/{kind}_per_step"] = sum(c.calls for c in of_kind)
            total += sent
    row["comm/bytes_per_step"] = total
    row["comm/collectives_per_step"] = sum(c.calls for c in data)
    if any(c.across_nodes is not None for c in data):
        across = [c for c in data if c.across_nodes]
        row["comm/inter_node_bytes_per_step"] = sum(wire_bytes(c.kind, c.nbytes, c.ranks) for c in across)
    busy, exposed = comm_time(data), exposed_time(data)
    row["time/comm_s"], row["time/comm_exposed_s"] = busy, min(exposed, busy)
    if emulated:
        row["time/comm_exposed_link_s"] = link_ideal(data)
    if busy > 0:
        row["comm/overlap_fraction"] = overlap_fraction(busy, exposed)
        row["comm/busbw_GBps"] = sum(bus_factor(c.kind, c.ranks) * c.nbytes for c in data) / busy / 1e9
    return row


def phase_row(marks: Sequence[tuple[str, float]]) -> dict[str, float]:
    """The sampled step's time/<phase>_s (summed where a phase recurs: one per micro-batch) and time/step_s."""
    row: dict[str, float] = {}
    for (_, begin), (phase, end) in zip(marks, marks[1:], strict=False):
        row[f"time/{phase}_s"] = row.get(f"time/{phase}_s", 0.0) + (end - begin)
    row["time/step_s"] = marks[-1][1] - marks[0][1] if marks else 0.0
    return row


_cuda_peak_before: dict[int, int] = {}  # device index -> the allocator's peak before its last reset


def reset_cuda_peak(device: torch.device) -> None:
    """Start the CUDA allocator's peak anew (a save's, a sampled step's), keeping the run's for cuda_peak_mb."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    _cuda_peak_before[index] = max(_cuda_peak_before.get(index, 0), torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_mb(device: torch.device) -> float:
    """The CUDA allocator's peak since the start of the run, in MiB, across the resets."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(torch.cuda.max_memory_allocated(device), _cuda_peak_before.get(index, 0)) / 2**20


def memory_row(held: dict[str, int], peaks: dict[str, int], allocator_peak: int | None = None) -> dict[str, float]:
    """memory/<kind>_mb (held at its instant), memory/<kind>_peak_mb (the most at any probe) and
    memory/peak_mb (the allocator's peak where there is one, else the sum of the kinds' peaks), in MiB."""
    row = {f"memory/{kind}_mb": nbytes / MIB for kind, nbytes in held.items()}
    row |= {f"memory/{kind}_peak_mb": nbytes / MIB for kind, nbytes in peaks.items()}
    if peaks or allocator_peak is not None:
        row["memory/peak_mb"] = (sum(peaks.values()) if allocator_peak is None else allocator_peak) / MIB
    return row


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its _local_tensor: to_local() runs an autograd Function, µs each, and
    the probe asks per gradient); any other tensor as it is."""
    if type(tensor) is torch.Tensor:
        return tensor
    local = getattr(tensor, "_local_tensor", None)
    return tensor if local is None else local


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """Each storage behind these tensors once, by its identity (stable when it is resized: zero
    stage 3's units are freed and regrown in place)."""
    storages = (_local(t).untyped_storage() for t in tensors)
    return {storage._cdata: storage for storage in storages}


def _nbytes(storages: Iterable[torch.UntypedStorage]) -> int:
    return sum([s.nbytes() for s in storages])


class MemoryProbe:
    """Bytes held now per kind (module docstring); `held`: what the strategy holds beyond these.

    The parameters are listed once (a walk of the model's modules costs more than a probe; they are
    the same objects for the whole run), the optimizer state's storages when its state is new (its
    first step, a resumed run's loaded state); each call reads their sizes now, and the gradients',
    which come and go within the step. `gathers`: the strategy's model parameters, where they are
    not the optimizer's own, are full copies it gathers per unit (zero stage 3): communication
    buffers. It runs a few times per sampled step, so it is written for speed (docs/performance.md)."""

    def __init__(
        self, model: nn.Module, optimizer: Optimizer, held: Callable[[], dict[str, int]], gathers: bool = False
    ) -> None:
        self.model, self.optimizer, self.held, self.gathers = model, optimizer, held, gathers
        self._owners: list[torch.Tensor] = []  # each parameter once: the model's and the optimizer's
        self._parameters: list[torch.UntypedStorage] = []
        self._gathered: list[torch.UntypedStorage] = []
        self._parameter_ids: set[int] = set()
        self._state: list[torch.UntypedStorage] = []
        self._state_of: tuple[int, int] = (0, -1)  # the state dict listed (its identity) and its entries then

    def begin(self) -> None:
        if not self._owners:
            stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
            self._owners = list({id(p): p for p in [*self.model.parameters(), *stepped]}.values())
            parameters = _storages(stepped if self.gathers else self._owners)
            gathered: dict[int, torch.UntypedStorage] = {}
            if self.gathers:
                gathered = {k: s for k, s in _storages(self.model.parameters()).items() if k not in parameters}
            self._parameters, self._gathered = list(parameters.values()), list(gathered.values())
            self._parameter_ids = set(parameters) | set(gathered)
        self._list_state()

    def parameter_storages(self) -> set[int]:
        """Every storage a parameter lives in (the activations' count leaves them out)."""
        return self._parameter_ids

    def _list_state(self) -> None:
        """The optimizer state's storages, listed again only when the state is another dict (a
        load_state_dict replaces it) or has more entries (a step made a parameter's)."""
        state = self.optimizer.state
        if (id(state), len(state)) != self._state_of:
            tensors = (v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))
            self._state = list(_storages(tensors).values())
            self._state_of = (id(state), len(state))

    def __call__(self) -> dict[str, int]:
        self._list_state()
        grads = {}
        for owner in self._owners:
            grad = owner.grad
            if grad is not None:
                storage = _local(grad).untyped_storage()
                grads[storage._cdata] = storage.nbytes()
        held = {
            "parameters": _nbytes(self._parameters),
            "gradients": sum(grads.values()),
            "optimizer_state": _nbytes(self._state),
            "comm_buffers": _nbytes(self._gathered),
        }
        for kind, nbytes in self.held().items():
            held[kind] = held.get(kind, 0) + nbytes
        return held


class SavedForBackward:
    """Entered around the sampled step's forward and loss: the bytes autograd saves for backward,
    each storage once, parameters left out (a Parameter, or a storage in `excluded`: zero's flat
    buffers, whose views the model's parameters are); the most of any forward.

    The pack hook returns the tensor itself (nothing is copied or moved); the hooks are installed
    on the sampled step only, so other steps pay nothing."""

    def __init__(self) -> None:
        self.excluded: set[int] = set()
        self.peak = 0
        self._seen: dict[int, int] = {}
        self._hooks: Any = None

    def __enter__(self) -> SavedForBackward:
        self._seen = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self.peak = max(self.peak, sum(self._seen.values()))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # Called for every tensor the forward saves, inside autograd: the common case (a plain tensor,
        # its base plain too) takes a few attribute reads; a Parameter's own isinstance runs Python.
        base = tensor if tensor._base is None else tensor._base  # a linear saves its weight's transpose
        if type(base) is not torch.Tensor and isinstance(base, nn.Parameter):  # (or FSDP2's unsharded one)
            return tensor  # a parameter: counted as such
        try:
            storage = (tensor if type(tensor) is torch.Tensor else _local(tensor)).untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without a storage of its own (sparse, nested)
            return tensor
        key = storage._cdata
        if key not in self.excluded:
            self._seen[key] = storage.nbytes()
        return tensor


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
