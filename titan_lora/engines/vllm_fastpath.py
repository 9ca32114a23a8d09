"""Fast install of titan_lora adapters in vLLM 0.32: a recorded module plan and batched slot writes.

vLLM's own path costs ~45 ms per SmolLM2 adapter (r16 on every linear) on CPU, nearly all of it
Python: `LoRAModel.from_lora_tensors` parses and maps every tensor name, registering packs q/k/v
and gate/up and scales every lora_B in place, then `activate_adapter` calls `set_lora` per module,
each zeroing and copying its slot piece by piece. A training run sends the same names every step, so:

- `AdapterPlan` records, from the first adapter vLLM itself built from those names, which tensors
  form each (packed) module's LoRA and with which scale; later versions are assembled from the
  record, already packed, and `register` adds them to vLLM's LRU manager without its packing pass.
- `install_slot_writer` makes the activation of our adapters one batched copy into the slot views
  (the scale applied on the way), with the bookkeeping of vLLM's LRU manager. Layers whose `set_lora`
  does more than copy (TP > 1, packed groups that must be split, classifier heads) send the whole
  adapter through vLLM's own `activate_adapter`.

Invariant kept throughout, as in vLLM: `lora_b * scaling` is a module's effective lora_B. vLLM's
`optimize()` folds the scale into lora_B and sets scaling to 1; adapters built here keep it unfolded.

The private vLLM names this drives come from `vllm_compat`; the worker extension imports this module
only on the vLLM versions `vllm_compat` lists as tested.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from titan_lora.engines.vllm_compat import (
    BaseLinearLayerWithLoRA,
    ClassificationHeadWithLoRA,
    LoRALayerWeights,
    LoRAModel,
    MergedColumnParallelLinearWithLoRA,
    PackedLoRALayerWeights,
    active_adapters,
    layer_weights,
    pack_merged,
    registered_adapters,
)
from titan_lora.transfer.host_copy import balanced_cut, in_two

# The set_lora implementations that only zero the slot and copy each slice into it.
_COPY_ONLY_SET_LORA = (BaseLinearLayerWithLoRA.set_lora, MergedColumnParallelLinearWithLoRA.set_lora)


@dataclasses.dataclass(frozen=True)
class _ModuleRow:
    """One module's LoRA as vLLM holds it once packed: per slice, tensor names and scale."""

    module: str
    rank: int
    alphas: tuple[float | None, ...]
    lora_a: tuple[str | None, ...]
    lora_b: tuple[str | None, ...]
    scalings: tuple[float | None, ...]
    packed: bool


class AdapterPlan:
    """How vLLM assembled an adapter from a set of tensor names, to assemble the next one alike."""

    def __init__(self, rank: int, rows: list[_ModuleRow]) -> None:
        self.rank = rank
        self.rows = rows
        # A row whose scale is not 1: vLLM folding the scales shows there (see `unfolded`).
        self._scaled_row = next((r for r in rows if any(x not in (None, 1) for x in r.scalings)), None)

    @classmethod
    def record(cls, models, model: LoRAModel, tensors: Mapping[str, torch.Tensor]) -> AdapterPlan | None:  # noqa: ANN001
        """Pack `model`, fresh from `from_lora_tensors(tensors)`, as registering it would (a no-op
        when vLLM registers it next), and return the plan behind it.

        None when vLLM converted or dropped a tensor, or the adapter saves whole modules: such
        adapters keep going through vLLM's builder.
        """
        name_of = {id(t): name for name, t in tensors.items()}
        # lora_B name -> scale, read before packing folds the scales (None: a tensor was converted)
        scalings = {name_of.get(id(w.lora_b)): w.scaling for w in model.loras.values()
                    if id(w.lora_a) in name_of}
        pack_merged(models, model)
        if None in scalings or 2 * len(scalings) != len(tensors) or model.modules_to_save:
            return None

        def names(ts: list[torch.Tensor | None]) -> tuple[str | None, ...] | None:
            found = tuple(None if t is None else name_of.get(id(t)) for t in ts)
            return None if any(n is None and t is not None for n, t in zip(found, ts)) else found

        rows = []
        for module, w in model.loras.items():
            is_packed = isinstance(w, PackedLoRALayerWeights)
            a = names(w.lora_a if is_packed else [w.lora_a])
            b = names(w.lora_b if is_packed else [w.lora_b])
            if a is None or b is None:
                return None
            alphas = tuple(w.lora_alphas) if is_packed else (w.lora_alpha,)
            rows.append(
                _ModuleRow(module, w.rank, alphas, a, b, tuple(scalings.get(n) for n in b), is_packed)
            )
        return cls(model.rank, rows)

    def build(self, lora_int_id: int, tensors: Mapping[str, torch.Tensor]) -> LoRAModel:
        """A packed LoRAModel over `tensors` (the plan's names), its scales not yet folded."""
        loras: dict[str, LoRALayerWeights] = {}
        for r in self.rows:
            a = [None if n is None else tensors[n] for n in r.lora_a]
            b = [None if n is None else tensors[n] for n in r.lora_b]
            if r.packed:
                loras[r.module] = PackedLoRALayerWeights(
                    r.module, r.rank, list(r.alphas), a, b, list(r.scalings)
                )
            else:
                loras[r.module] = LoRALayerWeights(r.module, r.rank, r.alphas[0], a[0], b[0], r.scalings[0])
        model = LoRAModel(lora_int_id, self.rank, loras)
        model.titan_plan, model.titan_tensors = self, tensors  # lets activation reuse a slot layout
        return model

    def unfolded(self, model: LoRAModel) -> bool:
        """True while `model`, built by this plan, keeps its scales unfolded (vLLM re-adding it would
        fold them into lora_B, after which the plan's scaled writes no longer apply)."""
        row = self._scaled_row
        if row is None:
            return True
        held = model.loras[row.module].scaling
        return list(row.scalings) == (held if isinstance(held, list) else [held])


def register(models, model: LoRAModel) -> None:  # noqa: ANN001
    """vLLM 0.32's LRU worker `add_adapter` for a model `AdapterPlan.build` made: it is packed
    already, so vLLM's packing pass (which would also fold every scale in place) is skipped."""
    models.remove_adapter(model.id)
    if len(models) + 1 > models.capacity:
        models.remove_oldest_adapter()
    registered_adapters(models)[model.id] = model
    models.activate_adapter(model.id)


def _copy_only(module) -> bool:  # noqa: ANN001
    """True when the layer's set_lora would only zero its slot and copy each slice in."""
    return getattr(module, "tp_size", 1) == 1 and type(module).set_lora in _COPY_ONLY_SET_LORA


def _slot_sources(models, lora_model: LoRAModel) -> list | None:  # noqa: ANN001
    """Per module of `models`: its slices' (lora_a, lora_b, scale), or None when it has no LoRA here.
    None overall when a layer needs vLLM's own set_lora."""
    per_module: list = []
    for name, module in models.modules.items():
        if isinstance(module, ClassificationHeadWithLoRA):  # it also swaps whole modules per slot
            return None
        lora = layer_weights(models, lora_model, name)
        if lora is None:
            per_module.append(None)
            continue
        if not _copy_only(module):
            return None
        packed = isinstance(lora.lora_a, list)
        a_list, b_list = (lora.lora_a, lora.lora_b) if packed else ([lora.lora_a], [lora.lora_b])
        scales = lora.scaling if packed else [lora.scaling]
        if len(a_list) != module.n_slices or len(b_list) != module.n_slices:
            return None
        per_module.append(list(zip(a_list, b_list, scales)))
    return per_module


@dataclasses.dataclass
class _SlotLayout:
    """Everything one activation writes into slot `index`, sources in the order of `dsts`."""

    zeros: list[torch.Tensor]
    dsts: list[torch.Tensor]
    sources: list[torch.Tensor]
    resets: list
    scaled: list[tuple[float, list[torch.Tensor]]]  # lora_B slot views to multiply by a scale
    cut: int  # where the batched copy splits over two threads


def _layout(models, per_module: list, index: int) -> _SlotLayout:  # noqa: ANN001
    """Slot views for the sources in `per_module`, in module order."""
    zeros, dsts, sources, resets, scaled = [], [], [], [], {}
    for module, slices in zip(models.modules.values(), per_module):
        if slices is None:
            resets.append(module)
            continue
        for i, (a, b, scale) in enumerate(slices):
            for src, stacked in ((a, module.lora_a_stacked[i]), (b, module.lora_b_stacked[i])):
                slot = stacked[index, 0]
                if src is None or src.shape != slot.shape:  # a partial write leaves stale values around it
                    zeros.append(slot)
                if src is not None:
                    dsts.append(slot[: src.shape[0], : src.shape[1]])
                    sources.append(src)
            if b is not None and scale not in (None, 1):
                scaled.setdefault(scale, []).append(dsts[-1])
    return _SlotLayout(zeros, dsts, sources, resets, list(scaled.items()), balanced_cut(dsts))


def _slot_layout(models, lora_model: LoRAModel, index: int) -> tuple[_SlotLayout, list[torch.Tensor]] | None:  # noqa: ANN001
    """The writes of `lora_model` into slot `index` and their sources; None if a layer needs vLLM's
    own set_lora. Adapters from one plan share a layout per slot, made once."""
    plan = getattr(lora_model, "titan_plan", None)
    if plan is None or not plan.unfolded(lora_model):
        per_module = _slot_sources(models, lora_model)
        if per_module is None:
            return None
        layout = _layout(models, per_module, index)
        return layout, layout.sources
    cache = models.__dict__.setdefault("_titan_slot_layouts", {})
    if (plan, index) not in cache:
        per_module = _slot_sources(models, lora_model)
        if per_module is None:
            return None
        layout = _layout(models, per_module, index)
        name_of = {id(t): n for n, t in lora_model.titan_tensors.items()}
        cache[(plan, index)] = (layout, [name_of[id(t)] for t in layout.sources])
    layout, names = cache[(plan, index)]
    tensors = lora_model.titan_tensors
    return layout, [tensors[n] for n in names]


def _activate(models, lora_id: int, fallback: Callable[[int], bool]) -> bool:  # noqa: ANN001
    """vLLM 0.32's LRUCacheLoRAModelManager.activate_adapter, with the set_lora loop batched."""
    active = active_adapters(models)
    if len(active) >= models.lora_slots:
        active.remove_oldest()
    index = next((i for i, held in enumerate(models.lora_index_to_id) if held is None), None)
    if index is None:
        raise ValueError("No free lora slots")
    lora_model = registered_adapters(models)[lora_id]
    found = _slot_layout(models, lora_model, index)
    if found is None:
        for lora in lora_model.loras.values():
            lora.optimize()  # vLLM's set_lora copies lora_B as it is: fold the scales first
        return fallback(lora_id)
    layout, sources = found
    active[lora_id] = None
    models.lora_index_to_id[index] = lora_model.id
    for module in layout.resets:
        module.reset_lora(index)
    if layout.zeros:
        torch._foreach_zero_(layout.zeros)
    in_two(torch._foreach_copy_, layout.dsts, sources, cut=layout.cut)
    for scale, b_slots in layout.scaled:  # the stored lora_B stays unscaled
        in_two(torch._foreach_mul_, b_slots, scale, cut=layout.cut and len(b_slots) // 2)
    active.touch(lora_id)
    return True


def install_slot_writer(models, is_ours: Callable[[int], bool]) -> None:  # noqa: ANN001
    """Activate adapters for which `is_ours(id)` holds with batched slot writes (idempotent)."""
    if getattr(models, "_titan_slot_writer", False):
        return
    original = models.activate_adapter

    def activate_adapter(lora_id: int) -> bool:
        if lora_id in active_adapters(models) or not is_ours(lora_id):
            return original(lora_id)
        return _activate(models, lora_id, original)

    models.activate_adapter = activate_adapter  # instance attribute: vLLM's own calls find it too
    models._titan_slot_writer = True
