"""One copy of a base model's weights per process, however many engines and trainers use it.

The embedded engine and the trainer both hold the frozen base model (``LocalBackend`` and the flow's in-process
training run them side by side): loaded separately, SmolLM2-135M in float32 costs 0.54 GB twice. Rule: a model
loaded with ``load_model(..., shared=True)`` while another of the same (folder, device, dtype) is alive in this
process gets module objects of its own (config, LoRA wrappers, attention setting, train/eval mode) over the SAME
parameter and buffer tensors (``twin``). Both users treat those tensors as read-only: the engine reads them (fused
projections are concatenated copies), the trainer trains only the LoRA weights peft adds around them. Something that
writes base weights in place (merging an adapter into them) must load without ``shared``.

The first load is kept as the pristine source (never handed out, so no user's LoRA wrappers are copied into the next
twin); each twin holds it, and the registry holds it only weakly, so the weights are freed with the last twin.

A user that gives a frozen weight a home of its own (``fold_lora_b`` moves it into a wider buffer whose first columns
are the weight) calls ``moved(old, new)``: where no other live twin reads ``old``, the source then reads the new
tensor, so the old storage is freed and twins made later share the new one (without it, a process with a trainer
alone would hold those weights twice: the source keeps the old storage alive for twins that may never come). Where
another twin reads ``old`` (an engine started first), the source keeps it: it stays alive anyway, and the new tensor
is then freed with its user.
"""

from __future__ import annotations

import copy
import threading
import weakref

_SOURCES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> the pristine first load
_HELD_BY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # twin -> its source, kept alive while the twin is
_LOCK = threading.Lock()


def twin(model):
    """A copy of `model`'s module tree whose parameters and buffers share `model`'s tensors (nothing is copied but
    Python objects and small non-tensor state). Parameters are new ``Parameter`` objects over the same storage, so
    ``requires_grad`` is the twin's own; tied weights stay tied."""
    import torch

    memo: dict[int, object] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b
    return copy.deepcopy(model, memo)


def shared_model(key: tuple, load):
    """A twin over the weights this process already holds for `key`, else over `load()`'s (kept as the source)."""
    with _LOCK:
        source = _SOURCES.get(key)
        if source is None:
            source = load()
            _SOURCES[key] = source
        model = twin(source)
        _HELD_BY[model] = source
    return model


def moved(old, new) -> None:
    """Point every source parameter that is ``old`` (same storage, offset, shape and device) at ``new`` (a tensor
    with ``old``'s values, e.g. a view into a wider buffer), unless a live twin still reads ``old``; parameters tied
    to one stay tied to one."""
    import torch

    def same(p) -> bool:
        return p is not None and p.device == old.device and p.data_ptr() == old.data_ptr() and p.shape == old.shape

    with _LOCK:
        for source in list(_SOURCES.values()):
            if any(src is source and any(same(p) for p in model.parameters()) for model, src in _HELD_BY.items()):
                continue
            replaced: dict[int, torch.nn.Parameter] = {}
            for module in source.modules():
                for name, p in module._parameters.items():
                    if same(p):
                        if id(p) not in replaced:
                            replaced[id(p)] = torch.nn.Parameter(new.detach(), requires_grad=p.requires_grad)
                        module._parameters[name] = replaced[id(p)]
