"""LoRA served unmerged: one set of base weights, an adapter per served version.

With LoRA training the torch engine never merges an adapter into its weights. Each published or
kept version is a `LoraAdapter` (per adapted module, A transposed and B transposed with the
LoRA scale folded in), and every version shares the base weights. A forward hook on each adapted
module adds `(x @ A^T) @ (s * B)^T` to the module's output for the rows of a forward that run a
version with an adapter (`AdapterHooks.set_rows`, called by the engine's worker thread before each
forward). The rows of one decode step may run different versions over the same base (a version
kept beside the published one, a canary, another user's adapter): each row gets its own adapter's
product, so they still decode in one forward. The mixed adapters are concatenated along the rank
(per module, once per mix of adapters) and a row mask zeroes, for each row, the columns of the
others: two matmuls per module whatever the number of adapters (`bench/multi_adapter.py`).
Publishing a version then costs its adapter's bytes (a few MB), not a copy of the model, and so
does keeping older versions servable beside it (`TorchEngine.load_version`). It is also what the
trainer computes: peft adds the same unmerged product to the same base output.

Invariants:
- A LoRA publish never writes the base weights: every version's output is the base's plus its own
  adapter's, and a version without an adapter (no hook active) is the base exactly.
- Only the engine's worker thread calls `set_rows` and runs forwards on the hooked model.
- Row b of a forward's output is the base's plus exactly the adapter `rows[b]` names (None: the
  base's alone): rows never see another row's adapter.
- An adapter whose modules the served model lacks, or whose shapes do not fit them, is refused
  (`ValueError`) before anything changes; its tensors are placed on the module's device and dtype.
- A placed adapter's matrices are views of one buffer, and so are a mix's concatenations
  (`_packed`): memory is taken and given back an adapter at a time, never a matrix at a time.
  `release` drops every adapter the hooks hold (the engine calls it when idle).
- The in-process trainer may share the base: its frozen parameters are the served model's tensors
  (`clawbridge_local.trainer.model.over_base`), once the engine has lent its base
  (`TorchEngine.lend_base`), after which the engine refuses full weights, so nothing writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["AdapterHooks", "LoraAdapter"]


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """The LoRA matrices of one version, by served module name (`model.layers.0.mlp.up_proj`)."""

    down: Mapping[str, torch.Tensor]
    """A^T, [in_features, r]."""
    up: Mapping[str, torch.Tensor]
    """(scale * B)^T, [r, out_features]."""

    @classmethod
    def from_peft(cls, tensors: Mapping[str, torch.Tensor], scale: float, where: str) -> LoraAdapter:
        """From peft-named tensors (`base_model.model.<module>.lora_A[.default].weight` and its
        `lora_B`), as an adapter export or a checkpoint holds them; `where` names them in errors."""
        return cls._filled(cls._pairs(tensors.keys(), where), lambda k: tuple(tensors[k].shape),
                           tensors.__getitem__, scale)

    @classmethod
    def from_safetensors(cls, path: Path, scale: float, where: str) -> LoraAdapter:
        """`from_peft` of a safetensors file, read one tensor at a time into the adapter's buffer
        (a whole file read first made ~2x the adapter in small blocks on the reading thread's heap,
        kept by the allocator after they were freed: issue 32 §2)."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return cls._filled(cls._pairs(f.keys(), where), lambda k: tuple(f.get_slice(k).get_shape()),
                               f.get_tensor, scale)

    @staticmethod
    def _pairs(keys: Iterable[str], where: str) -> list[tuple[str, str, str]]:
        """(module, its lora_A key, its lora_B key) of every adapted module among `keys`."""
        names = set(keys)
        pairs: list[tuple[str, str, str]] = []
        for key in sorted(names):
            if ".lora_A." not in key:
                continue
            b_key = key.replace(".lora_A.", ".lora_B.")
            if b_key not in names:
                raise ValueError(f"{where}: {key} has no lora_B beside it")
            pairs.append((key.split(".lora_A.")[0].removeprefix("base_model.model."), key, b_key))
        if not pairs:
            raise ValueError(f"{where} has no LoRA weights")
        return pairs

    @classmethod
    def _filled(cls, pairs: list[tuple[str, str, str]], shape: Callable[[str], tuple[int, ...]],
                read: Callable[[str], torch.Tensor], scale: float) -> LoraAdapter:
        """The adapter of `pairs`, float32 in one buffer (`_packed`'s reason): A^T and (scale*B)^T,
        each tensor read (`read`) when its place is filled."""
        cpu: Place = (torch.device("cpu"), torch.float32)
        views = iter(_carved([(cpu, torch.Size(shape(k)[::-1])) for _, a, b in pairs for k in (a, b)]))
        down: dict[str, torch.Tensor] = {}
        up: dict[str, torch.Tensor] = {}
        for module, a_key, b_key in pairs:
            down[module] = next(views).copy_(read(a_key).t())
            up[module] = next(views).copy_(read(b_key).t()).mul_(scale)
        return cls(down, up)

    @property
    def nbytes(self) -> int:
        """Bytes its tensors hold."""
        return sum(t.numel() * t.element_size() for m in (self.down, self.up) for t in m.values())

    def placed(self, model: torch.nn.Module) -> LoraAdapter:
        """This adapter checked against `model` and moved to each module's device and dtype, in one
        buffer (itself, when it is one buffer there already)."""
        modules = dict(model.named_modules())
        down: dict[str, torch.Tensor] = {}
        up: dict[str, torch.Tensor] = {}
        moved = False
        for name, a_t in self.down.items():
            mod = modules.get(name)
            weight = getattr(mod, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                raise ValueError(f"adapter module {name!r} is not a linear layer of the served model")
            b_t = self.up[name]
            out_features, in_features = weight.shape
            if a_t.shape[0] != in_features or b_t.shape[1] != out_features or a_t.shape[1] != b_t.shape[0]:
                raise ValueError(f"adapter module {name!r}: shapes {tuple(a_t.shape)} x {tuple(b_t.shape)} do not "
                                 f"fit its weight {tuple(weight.shape)}")
            down[name] = a_t.to(device=weight.device, dtype=weight.dtype)
            up[name] = b_t.to(device=weight.device, dtype=weight.dtype)
            moved = moved or down[name] is not a_t or up[name] is not b_t
        tensors = [*down.values(), *up.values()]
        if not moved and len({t.untyped_storage().data_ptr() for t in tensors}) == 1:
            return self
        return LoraAdapter(*_packed([down, up]))


Place = tuple[torch.device, torch.dtype]


def _carved(specs: Sequence[tuple[Place, torch.Size]]) -> list[torch.Tensor]:
    """Empty tensors of `specs` (where, shape), in order, each a view of one buffer per place."""
    sizes: dict[Place, int] = {}
    for where, shape in specs:
        sizes[where] = sizes.get(where, 0) + shape.numel()
    flat = {where: torch.empty(n, device=where[0], dtype=where[1]) for where, n in sizes.items()}
    offset = dict.fromkeys(sizes, 0)
    views: list[torch.Tensor] = []
    for where, shape in specs:
        views.append(flat[where][offset[where]: offset[where] + shape.numel()].view(shape))
        offset[where] += shape.numel()
    return views


def _packed(groups: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """`groups` copied into one buffer per device and dtype, each tensor a view of it.

    Why (issue 32 §2): an adapter is hundreds of small matrices (rank 32 on SmolLM2: ~420 of 72-200
    KiB, 43 MiB in all), each below glibc's mmap threshold, so each came from the heap, and users'
    adapters loaded and dropped at random left the heap fragmented: RSS grew by MiBs per load with
    the live tensors unchanged. One buffer is one mapping, given back whole when the adapter goes."""
    views = iter(_carved([((t.device, t.dtype), t.shape) for group in groups for t in group.values()]))
    return [{name: next(views).copy_(t) for name, t in group.items()} for group in groups]


Concatenation = tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int], ...]]
"""One module's mixed adapters: their A^T side by side, their (sB)^T stacked, and per adapter
(its index in the mix, its rank), in column order."""


def _concatenated(mixed: Sequence[LoraAdapter]) -> dict[str, Concatenation]:
    """Per module that an adapter of `mixed` adapts, the concatenation `AdapterHooks` multiplies by,
    written into one buffer per device and dtype (`_packed`'s reason)."""
    out: dict[str, Concatenation] = {}
    layouts: list[tuple[str, list[tuple[int, LoraAdapter]]]] = []
    specs: list[tuple[Place, torch.Size]] = []
    for name in dict.fromkeys(name for a in mixed for name in a.down):
        have = [(i, a) for i, a in enumerate(mixed) if name in a.down]
        first = have[0][1].down[name]
        rank = sum(a.down[name].shape[1] for _, a in have)
        where = (first.device, first.dtype)
        specs += [(where, torch.Size((first.shape[0], rank))), (where, torch.Size((rank, have[0][1].up[name].shape[1])))]
        layouts.append((name, have))
    views = iter(_carved(specs))
    for name, have in layouts:
        a_cat = torch.cat([a.down[name] for _, a in have], 1, out=next(views))
        b_cat = torch.cat([a.up[name] for _, a in have], 0, out=next(views))
        out[name] = (a_cat, b_cat, tuple((i, a.down[name].shape[1]) for i, a in have))
    return out


class AdapterHooks:
    """The forward hooks of one served model (module invariants)."""

    def __init__(self) -> None:
        self._rows: tuple[LoraAdapter | None, ...] = ()
        self._slots: tuple[int, ...] = ()
        """Per row, the index of its adapter in `_mixed` (-1: the base); empty when one version runs."""
        self._mixed: tuple[LoraAdapter, ...] = ()
        """The distinct adapters of a mixed forward (ordered by id, so a reordering of rows keeps `_cat`)."""
        self._cat: dict[str, Concatenation] = {}
        """Per module a mixed adapter adapts, the mixed adapters' A^T and (sB)^T concatenated along
        the rank and which adapter holds which columns; made when the mix changes, in one buffer,
        and kept while the same adapters mix (decode steps repeat them token after token)."""
        self._masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}
        """Per column layout, [B, 1, R]: 1 where a column belongs to the row's own adapter."""
        self._device: torch.device | str = "cpu"
        self._hooked: dict[str, Any] = {}

    @property
    def rows(self) -> tuple[LoraAdapter | None, ...]:
        """The adapter of each batch row of the forward that runs now (None: the base)."""
        return self._rows

    def set_rows(self, adapters: Sequence[LoraAdapter | None], device: torch.device | str = "cpu") -> None:
        """Before a forward: row b runs `adapters[b]` (None: the base); `device` is the model's."""
        self._rows = tuple(adapters)
        self._masks = {}
        first = self._rows[0] if self._rows else None
        if all(a is first for a in self._rows):  # one version for the whole batch: no mixing
            self._slots = ()
            return
        mixed = tuple(sorted({id(a): a for a in self._rows if a is not None}.values(), key=id))  # any row order
        if tuple(map(id, mixed)) != tuple(map(id, self._mixed)):
            self._mixed, self._cat = (), {}  # the old mix's buffer goes before the new one is made
            self._mixed, self._cat = mixed, _concatenated(mixed)
        index = {id(a): i for i, a in enumerate(mixed)}
        self._slots = tuple(-1 if a is None else index[id(a)] for a in self._rows)
        self._device = device

    def _mixed_delta(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """The rows' adapters' products in one pair of matmuls: x @ [A_1^T .. A_k^T], each row's
        columns of other adapters zeroed, @ [(sB_1)^T; ..; (sB_k)^T]."""
        entry = self._cat.get(name)
        if entry is None:
            return None
        a_cat, b_cat, layout = entry
        mask = self._masks.get(layout)
        if mask is None:
            cols: list[list[float]] = []
            for slot in self._slots:
                cols.append([1.0 if i == slot else 0.0 for i, r in layout for _ in range(r)])
            mask = torch.tensor(cols, dtype=x.dtype, device=self._device).unsqueeze(1)
            self._masks[layout] = mask
        return ((x @ a_cat) * mask) @ b_cat

    def release(self) -> None:
        """Forget the last forward's adapters and the mix's concatenation (the engine calls it when
        it goes idle): an adapter unloaded since is freed now, not at the next mixed forward."""
        self._rows, self._slots, self._mixed, self._cat, self._masks = (), (), (), {}, {}

    @property
    def installed(self) -> bool:
        """Whether any module is hooked (the model serves adapters)."""
        return bool(self._hooked)

    def prepare(self, model: torch.nn.Module, adapter: LoraAdapter) -> LoraAdapter:
        """`adapter` placed for `model`, with a hook on every module it adapts."""
        placed = adapter.placed(model)
        modules = dict(model.named_modules())
        for name in placed.down:
            if name not in self._hooked:
                self._hooked[name] = modules[name].register_forward_hook(self._hook(name))
        return placed

    def _hook(self, name: str) -> Callable[[torch.nn.Module, tuple[Any, ...], torch.Tensor], torch.Tensor | None]:
        def add_delta(_: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
            if not self._rows:
                return None
            x = args[0]
            if not self._slots:  # every row runs the same version
                adapter = self._rows[0]
                if adapter is None or name not in adapter.down:
                    return None
                return out + (x @ adapter.down[name]) @ adapter.up[name]
            delta = self._mixed_delta(name, x)
            return None if delta is None else out + delta

        return add_delta

