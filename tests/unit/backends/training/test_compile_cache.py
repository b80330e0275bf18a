"""The compile cache's plumbing in one process: the stored file's format, what is refused (corrupt, made for other
settings, a name that is not a digest), a store that cannot be written, and the run store on a local folder and on
S3 (moto). Compiling itself, and loading what another process compiled: test_compile_cache_processes.py."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from backends.training.compile_cache import CompileCache, decode, encode, key_fields, key_of
from storage.compile_cache import StoreCompileCache
from storage.layout import compile_cache_file
from storage.names import InvalidNameError
from storage.store import RunStore

TORCH_LOAD = torch.compiler.load_cache_artifacts
FIELDS = key_fields(torch.device("cpu"), torch.float32, {"lora_rank": 8}, {"hidden_size": 64, "_name_or_path": "/x"})


class _Artifacts:
    """torch.compiler's save/load pair standing in for a process that compiled ``payload`` (no compile here)."""

    def __init__(self, payload: bytes | None = b"compiled"):
        self.payload, self.loaded = payload, []

    def save(self):
        info = types.SimpleNamespace(artifacts={"inductor": ["a", "b"]})
        return None if self.payload is None else (self.payload, info)

    def load(self, data: bytes):
        self.loaded.append(data)
        return types.SimpleNamespace(artifacts={"inductor": ["a", "b"], "aot_autograd": ["c"]})


@pytest.fixture
def artifacts(monkeypatch):
    fake = _Artifacts()
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", fake.save)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", fake.load)
    return fake


def test_the_key_names_what_makes_artifacts_valid_not_where_the_model_lives():
    same = key_fields(torch.device("cpu"), torch.float32, {"lora_rank": 8}, {"hidden_size": 64, "_name_or_path": "/y"})
    assert key_of(same) == key_of(FIELDS) and len(key_of(FIELDS)) == 64
    for other in (key_fields(torch.device("cpu"), torch.bfloat16, {"lora_rank": 8}, {"hidden_size": 64}),
                  key_fields(torch.device("cpu"), torch.float32, {"lora_rank": 16}, {"hidden_size": 64}),
                  key_fields(torch.device("cpu"), torch.float32, {"lora_rank": 8}, {"hidden_size": 128})):
        assert key_of(other) != key_of(FIELDS)
    assert FIELDS["torch"] == torch.__version__ and FIELDS["isa"] == torch.backends.cpu.get_cpu_capability()


def test_a_file_round_trips_and_every_damage_is_refused():
    data = encode(FIELDS, b"payload-bytes")
    assert decode(data, FIELDS) == b"payload-bytes"
    other = {**FIELDS, "torch": "0.0"}
    for bad, why in ((data[:-1], "truncated or corrupt"), (data[:-1] + b"X", "truncated or corrupt"),
                     (b"garbage", "not a trajflow"), (data[:30], "truncated header"),
                     (encode(other, b"payload-bytes"), "other settings")):
        with pytest.raises(ValueError, match=why):
            decode(bad, FIELDS)


def test_a_name_that_is_not_a_digest_never_leaves_the_folder():
    assert compile_cache_file("a" * 64) == f"compile-cache/{'a' * 64}.bin"
    for bad in ("../../etc/passwd", "A" * 64, "a" * 63, "/" + "a" * 63, None):
        with pytest.raises(InvalidNameError):
            compile_cache_file(bad)


def test_saved_once_then_loaded_by_the_next_trainer(store_root, artifacts):
    store = StoreCompileCache(RunStore(store_root, "project", "run"))
    first = CompileCache(store, FIELDS)
    first.load()
    first.save()
    first.save()  # once
    assert first.runs == {"compile_cache_loaded": 0, "compile_cache_hits": 0, "compile_cache_saved": 2}
    assert store.get(first.key) == encode(FIELDS, b"compiled")
    artifacts.payload = b"another process's"
    second = CompileCache(store, FIELDS)
    second.load()
    second.save()
    assert artifacts.loaded == [b"compiled"] and second.runs["compile_cache_loaded"] == 3
    assert second.runs["compile_cache_saved"] == 0 and store.get(first.key) == encode(FIELDS, b"compiled")  # kept


@pytest.mark.parametrize("stored", ["corrupt", "mismatched", "refused by torch"])
def test_a_bad_entry_is_ignored_with_a_warning_and_replaced(tmp_path, artifacts, caplog, stored, monkeypatch):
    store = StoreCompileCache(RunStore(str(tmp_path), "project", "run"))
    cache = CompileCache(store, FIELDS)
    store.put(cache.key, {"corrupt": encode(FIELDS, b"compiled")[:-3],
                          "mismatched": encode({**FIELDS, "dtype": "torch.bfloat16"}, b"compiled"),
                          "refused by torch": encode(FIELDS, b"not torch's format")}[stored])
    if stored == "refused by torch":  # torch's own reader: it logs and loads nothing
        monkeypatch.setattr(torch.compiler, "load_cache_artifacts", TORCH_LOAD)
    with caplog.at_level(logging.WARNING, logger="trajflow"):
        cache.load()
    assert cache.runs["compile_cache_loaded"] == 0 and "compiling as usual" in caplog.text
    cache.save()
    assert store.get(cache.key) == encode(FIELDS, b"compiled")  # a valid entry took the bad one's place


def test_a_store_that_cannot_be_written_costs_only_a_warning(tmp_path, artifacts, caplog):
    run = tmp_path / "project" / "run"
    run.mkdir(parents=True)
    (run / "compile-cache").write_text("a file where the folder goes")  # refuses writes, even to root
    cache = CompileCache(StoreCompileCache(RunStore(str(tmp_path), "project", "run")), FIELDS)
    with caplog.at_level(logging.WARNING, logger="trajflow"):
        cache.load()
        cache.save()
    assert cache.runs["compile_cache_saved"] == 0 and "write of" in caplog.text


def test_nothing_compiled_nothing_stored(tmp_path, artifacts):
    artifacts.payload = None
    store = StoreCompileCache(RunStore(str(tmp_path), "project", "run"))
    cache = CompileCache(store, FIELDS)
    cache.load()
    cache.save()
    assert store.get(cache.key) is None and cache.runs["compile_cache_saved"] == 0


def test_only_the_writing_rank_stores(tmp_path, artifacts):
    store = StoreCompileCache(RunStore(str(tmp_path), "project", "run"))
    cache = CompileCache(store, FIELDS)
    cache.load()
    cache.save(write=False)
    assert store.get(cache.key) is None and cache.runs["compile_cache_saved"] == 0


def test_a_trainer_without_warm_up_stores_after_its_first_step_and_reports_it(tiny_model_path, tmp_path, artifacts):
    from backends.training.config import TrainerConfig
    from backends.training.trainer import GRPOTrainer
    from tests.fixtures_trainer import synthetic_group

    store = StoreCompileCache(RunStore(str(tmp_path), "project", "run"))
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(compile_cache="on", warm_up="off"), compile_cache=store)
    assert trainer.compile_cache is not None and store.get(trainer.compile_cache.key) is None
    trainer.train_step([synthetic_group([0.0, 1.0])])
    assert trainer.warm_up_runs["compile_cache_saved"] == 2
    assert decode(store.get(trainer.compile_cache.key), trainer.compile_cache.fields) == b"compiled"
    off = GRPOTrainer(str(tiny_model_path), TrainerConfig(warm_up="off"), compile_cache=store)  # 'auto': CUDA only
    assert off.compile_cache is None
