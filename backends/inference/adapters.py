"""LoRA adapters served by the engine: fetching them, reading peft files, and the names requests use.

- **Where from.** ``lora_path`` is a local folder, or a storage URI (``s3://…``, ``file://…``, anything fsspec
  opens; which ones a server accepts is `backends.serving.adapter_sources`'s rule). A URI is downloaded on every
  load into a temporary folder and kept as ``<cache>/adapters/<sha256 of its files>[:32]/`` (renamed into place, so
  a crash never leaves a half copy): the cache is keyed by content, so a reload of the same URI after its files
  changed serves the new weights, and a copy, once there, never changes. Only ``adapter_config.json`` and
  ``adapter_model.safetensors`` are read (never pickle files).
- **What is accepted.** peft ``LORA`` adapters on the attention and MLP projections (q/k/v/o, gate/up/down) of the
  served base model, any rank up to the engine's maximum, ``lora_alpha / r`` scaling (``/ sqrt(r)`` with rslora).
  DoRA, embedding or lm_head LoRA, and ``modules_to_save`` are refused with a message naming the problem, and so
  is an adapter whose ``r`` is not an integer, whose ``lora_alpha`` is not a finite number, or whose weights (B
  scaled by ``lora_alpha / r``) are NaN, infinite, or beyond the serving dtype's range: one such adapter in a batch
  would otherwise reach other rows (`lora_slots`).
- **Names.** The base model is served under its own name. Adapters are registered under their ``lora_name``; by
  convention ``"<name>@<step>"``; a name has 1-200 characters and no whitespace, control characters, ``/``,
  backslash or ``..`` (it may end up in paths and logs). A bare ``"<name>"`` that is not itself registered means
  the highest registered ``"<name>@<k>"``. Anything else is unknown, and the error lists the names that exist.
- **Memory.** Every registered adapter stays registered until unloaded; its weights are kept in host memory for the
  ``max_cpu_loras`` most recently used adapters and re-read from the local copy when needed again. How many sit on
  the device at once (``max_loras``) is the engine's business (`lora_slots.LoraSlots`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from storage.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter cannot be loaded (bad path, bad files, incompatible with the base model)."""


class UnknownModel(LookupError):
    """A request named a model that is neither the base model nor a registered adapter."""

    def __init__(self, name: str, available: list[str]):
        self.name, self.available = name, available
        super().__init__(f"The model `{name}` does not exist. Available models: {', '.join(available)}")


@dataclass
class HostAdapter:
    """A LoRA adapter's weights in host memory: ``weights[(layer, module)] = (A [r, in], B [out, r])``; the
    delta of that module is ``scale * x @ A.T @ B.T``."""

    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AdapterEntry:
    """A registered adapter: `uid` changes whenever a name is (re)loaded, so stale device copies are never reused."""

    uid: int
    name: str
    source: str
    local_path: Path
    rank: int
    step: int | None = field(default=None)


def _is_uri(path: str) -> bool:
    return "://" in path


def fetch_adapter(path: str, cache_dir: Path) -> Path:
    """Local folder holding the adapter files: `path` itself, or the content-keyed copy of a storage URI."""
    if not _is_uri(path):
        local = Path(path).expanduser()
        if not (local / ADAPTER_CONFIG).is_file():
            raise AdapterError(f"lora_path {path!r}: no adapter_config.json there")
        return local
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(path)
    except (ValueError, ImportError) as e:  # unknown scheme, or its package is not installed
        raise AdapterError(f"lora_path {path!r}: {e}") from e
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="download.tmp-", dir=cache_dir))
    try:
        fs.invalidate_cache(root)  # a listing cached by an earlier load would hide changed or removed files
        digest = hashlib.sha256()
        for name in ADAPTER_FILES:
            remote = root.rstrip("/") + "/" + name
            try:
                fs.get(remote, str(tmp / name))
            except FileNotFoundError:
                raise AdapterError(f"lora_path {path!r}: {name} not found") from None
            except OSError as e:
                raise AdapterError(f"lora_path {path!r}: cannot read {name} ({e})") from e
            with open(tmp / name, "rb") as f:
                digest.update(name.encode() + b"\0" + hashlib.file_digest(f, "sha256").digest())
        target = cache_dir / digest.hexdigest()[:32]
        if not all((target / name).is_file() for name in ADAPTER_FILES):
            try:
                tmp.rename(target)
            except OSError:  # another load of the same contents won the rename
                if not all((target / name).is_file() for name in ADAPTER_FILES):
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def read_adapter(local: Path, layout: dict[str, tuple[int, int]], num_layers: int, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> HostAdapter:
    """Read and check a peft LoRA folder against the base model's `layout` (module -> (in, out)); its weights must
    be finite once scaled and cast to `dtype`, the dtype the engine serves in."""
    try:
        config = json.loads((local / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{local}: unreadable adapter_config.json ({e})") from e
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{local}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise AdapterError(f"{local}: DoRA adapters are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{local}: modules_to_save={config['modules_to_save']} is not supported (LoRA only)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"{local}: per-module rank_pattern/alpha_pattern are not supported")
    rank = config.get("r")
    if not _is_int(rank):
        raise AdapterError(f"{local}: adapter_config.json r must be an integer, got {rank!r}")
    if not 1 <= rank <= max_rank:
        raise AdapterError(f"{local}: rank r={rank} outside 1..{max_rank} (raise max_lora_rank to serve it)")
    alpha = _finite_number(config.get("lora_alpha", rank))
    if alpha is None:
        raise AdapterError(f"{local}: adapter_config.json lora_alpha must be a finite number, "
                           f"got {config.get('lora_alpha')!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_file = local / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise AdapterError(f"{local}: adapter_model.safetensors missing (pickle .bin files are not read)")
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_file), device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for corrupt files
        raise AdapterError(f"{local}: unreadable adapter_model.safetensors ({e})") from e
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in LORA_MODULES:
            raise AdapterError(f"{local}: unsupported tensor {key!r} (only LoRA on {', '.join(LORA_MODULES)})")
        layer, module = int(m.group(1)), m.group(2)
        if layer >= num_layers:
            raise AdapterError(f"{local}: {key!r} names layer {layer}, the base model has {num_layers}")
        parts.setdefault((layer, module), {})[m.group(3)] = tensor
    if not parts:
        raise AdapterError(f"{local}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{local}: layer {layer} {module} lacks lora_{'B' if 'A' in ab else 'A'}")
        fan_in, fan_out = layout[module]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise AdapterError(
                f"{local}: layer {layer} {module} has A{tuple(a.shape)} B{tuple(b.shape)}, the base model needs "
                f"A({rank}, {fan_in}) B({fan_out}, {rank}); was it trained on another base model?"
            )
        a, b = a.float(), b.float()
        _check_finite(local, layer, module, a, b, scale, dtype)
        weights[(layer, module)] = (a, b)
    return HostAdapter(rank=rank, scale=scale, weights=weights)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_number(value) -> float | None:
    if not (_is_int(value) or isinstance(value, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an integer beyond float range
        return None
    return value if math.isfinite(value) else None


def _check_finite(local: Path, layer: int, module: str, a: torch.Tensor, b: torch.Tensor, scale: float,
                  dtype: torch.dtype) -> None:
    """A and scale * B must be finite in the dtype they are served in (a huge lora_alpha overflows bf16)."""
    largest = torch.finfo(dtype).max
    for part, tensor in (("lora_A", a), ("lora_B * lora_alpha / r", b * scale)):
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"{local}: layer {layer} {module} {part} holds NaN or infinite values")
        if bool((tensor.abs() > largest).any()):
            raise AdapterError(f"{local}: layer {layer} {module} {part} exceeds {dtype}'s range ({largest:.3g}); "
                               "is lora_alpha far too large?")


def _step_of(name: str, base: str) -> int | None:
    if name.startswith(base + "@"):
        tail = name[len(base) + 1 :]
        if tail.isdigit():
            return int(tail)
    return None


class AdapterRegistry:
    """Names -> adapters, thread-safe. `layout`/`num_layers`/`max_rank` describe what the base model accepts."""

    def __init__(self, base_names: list[str], layout: dict[str, tuple[int, int]], num_layers: int,
                 max_rank: int, cache_dir: Path, max_cpu_loras: int = 16, dtype: torch.dtype = torch.float32):
        self.base_names = list(base_names)
        self.layout, self.num_layers, self.max_rank, self.dtype = layout, num_layers, max_rank, dtype
        self.cache_dir = Path(cache_dir)
        self.max_cpu_loras = max(1, max_cpu_loras)
        self._entries: dict[str, AdapterEntry] = {}
        self._host: OrderedDict[int, HostAdapter] = OrderedDict()
        self._uids = 0
        self._lock = threading.Lock()

    def load(self, name: str, path: str, replace: bool = False) -> AdapterEntry:
        """Register `name` -> adapter at `path` (fetched and checked now, so errors surface to the caller)."""
        if (not name or len(name) > 200 or any(c.isspace() or ord(c) < 32 or c in "/\\" for c in name)
                or ".." in name):
            raise AdapterError(f"lora_name {name!r}: must be 1-200 characters without spaces, control characters, "
                               "'/', '\\' or '..'")
        if name in self.base_names:
            raise AdapterError(f"lora_name {name!r} is the base model's name")
        with self._lock:
            old = self._entries.get(name)
        if old is not None and not replace:
            if old.source == path:
                return old
            raise AdapterError(f"adapter {name!r} is already loaded from {old.source!r}; unload it first "
                               "(or pass load_inplace=true)")
        local = fetch_adapter(path, self.cache_dir / "adapters")
        host = read_adapter(local, self.layout, self.num_layers, self.max_rank, self.dtype)
        with self._lock:
            self._uids += 1
            entry = AdapterEntry(uid=self._uids, name=name, source=path, local_path=local, rank=host.rank)
            prev = self._entries.get(name)
            if prev is not None:
                self._host.pop(prev.uid, None)
            self._entries[name] = entry
            self._remember(entry.uid, host)
        return entry

    def unload(self, name: str) -> AdapterEntry:
        """Forget `name`; raises UnknownModel listing what exists."""
        with self._lock:
            entry = self._entries.pop(name, None)
            if entry is None:
                raise UnknownModel(name, self._names_locked())
            self._host.pop(entry.uid, None)
            return entry

    def resolve(self, model: str) -> AdapterEntry | None:
        """The adapter a request's `model` means (None: the base model)."""
        with self._lock:
            if model in self.base_names:
                return None
            if model in self._entries:
                return self._entries[model]
            steps = [(s, e) for n, e in self._entries.items() if (s := _step_of(n, model)) is not None]
            if steps:
                return max(steps, key=lambda t: t[0])[1]
            raise UnknownModel(model, self._names_locked())

    def names(self) -> list[str]:
        """Base model names first, then adapters in load order."""
        with self._lock:
            return self._names_locked()

    def _names_locked(self) -> list[str]:
        return self.base_names + list(self._entries)

    def entries(self) -> list[AdapterEntry]:
        with self._lock:
            return list(self._entries.values())

    def is_live(self, uid: int) -> bool:
        with self._lock:
            return any(e.uid == uid for e in self._entries.values())

    def host_weights(self, entry: AdapterEntry) -> HostAdapter:
        """The adapter's weights (re-read from its local copy if they were dropped from host memory)."""
        with self._lock:
            host = self._host.get(entry.uid)
            if host is not None:
                self._host.move_to_end(entry.uid)
                return host
        host = read_adapter(entry.local_path, self.layout, self.num_layers, self.max_rank, self.dtype)
        with self._lock:
            self._remember(entry.uid, host)
        return host

    def _remember(self, uid: int, host: HostAdapter) -> None:
        self._host[uid] = host
        self._host.move_to_end(uid)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
