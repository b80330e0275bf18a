"""The trainer's torch.compile artifacts carried from one process to the next through the run's storage.

A fresh process compiles every torch.compile'd kernel again unless the local inductor/Triton caches hold it; on a
fresh machine (spot instance, restart) they are empty. PyTorch's portable cache ("mega cache") serialises what the
process compiled, ``torch.compiler.save_cache_artifacts() -> (bytes, info)``, and ``load_cache_artifacts(bytes)``
writes those entries into the local caches of another process, so its compiles become cache hits.

The key: ``sha256`` of the canonical JSON of what makes the artifacts valid (``key_fields``): this format's version,
torch's and Triton's versions, the device (CUDA name and compute capability; on the CPU the machine and the vector
ISA inductor writes for), the compute dtype, the trainer's kernel-affecting settings (``TrainerConfig.COMPILE_FIELDS``)
and the model's architecture (its config without its path). The stored name is that digest, never a user's string.

The file: a first line ``trajflow-compile-cache``, a JSON line with the key's fields, the payload's sha256 and size,
then the payload. A file whose header, hash or fields do not match, or which torch refuses, is ignored with a warning:
the cache only saves time, so no failure of it stops the trainer.

Choices:
1. Saved once per key: when the store has no valid entry for it, after the first compiles (``GRPOTrainer.warm_up``,
   or the first step without it), by rank 0 only. A valid entry is never replaced, even where this process compiled
   more (a later graph: the KL passes' no-grad forward, say); a corrupt or mismatched one is.
2. Loaded once, at trainer construction before the warm-up: compiles that ran in this process earlier (another
   component's) are not affected; those after it read the loaded entries.
3. What the entries spare is torch's own: tracing, lowering and code generation (FX graph and AOT autograd entries).
   Inductor bundles the Triton kernels' binaries into its graph entries by default (its config's
   ``bundle_triton_into_fx_graph_cache``), so on CUDA they come along; on the CPU the C++ kernels are built again by
   the compiler from the loaded source (seen on the CPU: the loading process's fresh inductor folder held the same
   12 built libraries as the saving one's).
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from importlib import metadata
from typing import Protocol, runtime_checkable

import torch

log = logging.getLogger("trajflow")

FORMAT = 1
MAGIC = b"trajflow-compile-cache\n"
# inductor's counters of local cache lookups (FX graphs; AOT autograd's joint graphs)
HIT_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"))


@runtime_checkable
class ArtifactStore(Protocol):
    """Where compile artifacts live between processes (``storage.compile_cache.StoreCompileCache`` in the flow)."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...


def _triton_version() -> str | None:
    for name in ("triton", "pytorch-triton"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def device_fields(device: torch.device) -> dict:
    """What the compiled code was generated for: the CUDA device's name and capability, or the CPU's machine and the
    vector ISA inductor's C++ kernels use."""
    if device.type == "cuda":
        return {"device": torch.cuda.get_device_name(device),
                "capability": list(torch.cuda.get_device_capability(device))}
    return {"device": device.type, "machine": platform.machine(), "isa": torch.backends.cpu.get_cpu_capability()}


def key_fields(device: torch.device, dtype: torch.dtype, settings: dict, model_config: dict) -> dict:
    """Everything the key hashes (see the module docstring); ``settings``: the kernel-affecting trainer settings."""
    return {"format": FORMAT, "torch": torch.__version__, "triton": _triton_version(), **device_fields(device),
            "dtype": str(dtype), "settings": settings,
            "model": {k: v for k, v in model_config.items() if k not in ("_name_or_path", "transformers_version")}}


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def key_of(fields: dict) -> str:
    """sha256 hex of the canonical JSON of ``fields``."""
    return hashlib.sha256(_canonical(fields)).hexdigest()


def encode(fields: dict, payload: bytes) -> bytes:
    """The stored file: magic line, header line (fields, payload sha256 and size), payload."""
    header = {"fields": json.loads(_canonical(fields)), "sha256": hashlib.sha256(payload).hexdigest(),
              "size": len(payload)}
    return MAGIC + _canonical(header) + b"\n" + payload


def decode(data: bytes, fields: dict) -> bytes:
    """The payload of a stored file made for ``fields``; ValueError saying why it is not one."""
    if not data.startswith(MAGIC):
        raise ValueError("not a trajflow compile cache file")
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        raise ValueError("truncated header")
    try:
        header = json.loads(data[len(MAGIC):end])
    except ValueError as exc:
        raise ValueError(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("fields") != json.loads(_canonical(fields)):
        raise ValueError("made for other settings (torch, device, dtype, trainer settings or model)")
    payload = data[end + 1:]
    if len(payload) != header.get("size") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("payload size or sha256 differs from its header (truncated or corrupt)")
    return payload


def _count(info) -> int:
    """Entries of a ``torch.compiler`` CacheInfo (0 where a torch version names them otherwise)."""
    return sum(len(v) for v in getattr(info, "artifacts", {}).values())


def _hits() -> int:
    from torch._dynamo.utils import counters

    return sum(counters[group][name] for group, name in HIT_COUNTERS)


class CompileCache:
    """One trainer's compile artifacts under one key of an ``ArtifactStore``: ``load`` before the first compile,
    ``save`` after it. ``runs``: what happened, for ``GRPOTrainer.warm_up_runs`` (``compile_cache_loaded``: entries
    loaded; ``compile_cache_hits``: local cache hits since the load; ``compile_cache_saved``: entries saved)."""

    def __init__(self, store: ArtifactStore, fields: dict):
        self.store, self.fields, self.key = store, fields, key_of(fields)
        self.runs = {"compile_cache_loaded": 0, "compile_cache_hits": 0, "compile_cache_saved": 0}
        self._valid_stored = False
        self._saved = False
        self._hits_at_load = 0

    def _warn(self, action: str, reason) -> None:
        log.warning("compile cache %s %s in %r: %s (compiling as usual)", action, self.key[:12], self.store, reason)

    def load(self) -> None:
        """Load the stored entry for this key into the local compile caches, if there is a valid one."""
        self._hits_at_load = _hits()
        try:
            data = self.store.get(self.key)
        except Exception as exc:  # noqa: BLE001 - an unreachable store only costs the compile
            self._warn("read of", exc)
            return
        if data is None:
            return
        try:
            info = torch.compiler.load_cache_artifacts(decode(data, self.fields))
            if info is None:  # torch logs why and loads nothing
                raise ValueError("torch could not read the artifacts")
        except Exception as exc:  # noqa: BLE001 - a bad file is ignored, and replaced by the next save
            self._warn("entry", exc)
            return
        self._valid_stored = True
        self.runs["compile_cache_loaded"] = _count(info)
        log.info("compile cache %s: %d artifacts loaded", self.key[:12], self.runs["compile_cache_loaded"])

    def save(self, write: bool = True) -> None:
        """Once: record the hits since ``load``; with ``write`` (rank 0), store this process's artifacts unless a valid
        entry is stored."""
        if self._saved:
            return
        self._saved = True
        self.runs["compile_cache_hits"] = _hits() - self._hits_at_load
        if self._valid_stored or not write:
            return
        try:
            saved = torch.compiler.save_cache_artifacts()
            if saved is None:  # nothing compiled in this process
                return
            payload, info = saved
            self.store.put(self.key, encode(self.fields, payload))
        except Exception as exc:  # noqa: BLE001 - a read-only or unreachable store only costs the next compile
            self._warn("write of", exc)
            return
        self.runs["compile_cache_saved"] = _count(info)
        log.info("compile cache %s: %d artifacts saved", self.key[:12], self.runs["compile_cache_saved"])
