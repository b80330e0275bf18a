"""No host-device sync inside the trainer's micro-batch loop, and a step's reads of the device do not grow with its
micro-batches.

On CUDA a sync (a scalar read, ``tolist``, ``.cpu()``, ``nonzero``, a boolean mask's indexing) makes the host wait for
every kernel already queued, so the next micro-batch's launches start only once the GPU has drained. On the CPU the
same calls are counted here: ``SyncCounter`` sees the aten ops that read a device value back to the host (through
a dispatch mode, so it catches them inside torch, transformers and peft too) and the Python-level copies to the
host."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backends.training.config import TrainerConfig
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import step_rows, synthetic_group

pytestmark = pytest.mark.usefixtures("single_thread")

# aten ops whose result size or value comes from the device: each is a sync on CUDA
SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "unique", "_unique",
            "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "bincount", "histc"}
HOST_COPIES = ("tolist", "cpu", "numpy")


class SyncCounter(TorchDispatchMode):
    """Counts host-device syncs in the block, by what made them (``counts``)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.paused = False
        self._patched = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        if self.paused:
            pass
        elif name in SYNC_OPS and not (name == "repeat_interleave" and kwargs.get("output_size") is not None):
            self.counts[name] += 1
        elif name.startswith("index") and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                               for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple))
                                                         else ())):
            self.counts[f"{name} (boolean mask)"] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for method in HOST_COPIES:
            original = getattr(torch.Tensor, method)

            def counted(tensor, *args, _original=original, _name=method, **kwargs):
                self.counts[_name] += 0 if self.paused else 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, counted)
            self._patched.append((method, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._patched:
            setattr(torch.Tensor, method, original)
        self._patched.clear()
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def test_counter_sees_each_kind_of_sync():
    t = torch.arange(6.0)
    with SyncCounter() as syncs:
        float(t.sum()), int(t.max()), bool(t.any()), t.tolist(), t.cpu()
        t[t > 2], torch.nonzero(t), t.repeat_interleave(torch.tensor([1] * 6))
        t.repeat_interleave(torch.tensor([1] * 6), output_size=6)  # told its size: no sync
    assert syncs.counts["_local_scalar_dense"] == 3 and syncs.counts["tolist"] == 1 and syncs.counts["cpu"] == 1
    assert syncs.counts["nonzero"] == 1 and syncs.counts["repeat_interleave"] == 1
    assert syncs.counts["index (boolean mask)"] == 1


GROUPS = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0])]
CONFIGS = {
    "cispo": dict(),
    "ppo with tis": dict(loss="ppo", tis_cap=2.0),
    "gspo": dict(loss="gspo"),
    "fused": dict(fused_lora="on", memory_efficient_ops="on", dtype="bfloat16"),
    "checkpointed": dict(gradient_checkpointing=True, fused_lora="on"),
}


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_no_sync_inside_a_micro_batch(tiny_model_path, config):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(micro_batch_tokens=8, **CONFIGS[config]))
    trainer.train_step(GROUPS)  # first-call work (lazy imports, one-off probes) out of the way
    batches = trainer.micro_batches(step_rows(GROUPS))
    eps, eps_high = trainer.config.clip_range()
    with trainer.lora_casts_scope():
        trainer.model.train()
        for mb in batches:
            with SyncCounter() as syncs:
                trainer._micro_batch_step(mb, eps, eps_high)
            assert syncs.total == 0, dict(syncs.counts)
    trainer.optimizer.zero_grad(set_to_none=True)


def test_a_steps_device_reads_do_not_grow_with_its_micro_batches(tiny_model_path):
    totals = {}
    for budget in (64, 8):  # one micro-batch, then one per row
        trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(micro_batch_tokens=budget, fused_lora="on"))
        trainer.train_step(GROUPS)
        with SyncCounter() as syncs:
            # not counted: the CPU's AdamW reads its step counters, CPU tensors (CUDA's fused AdamW keeps them on the
            # GPU and reads none)
            trainer.optimizer.register_step_pre_hook(lambda *_: setattr(syncs, "paused", True))
            trainer.optimizer.register_step_post_hook(lambda *_: setattr(syncs, "paused", False))
            metrics = trainer.train_step(GROUPS)
        totals[int(metrics["micro_batches"])] = dict(syncs.counts)
    (one, many) = sorted(totals)
    assert one == 1 and many >= 3
    assert totals[one] == totals[many]
    assert totals[many] == {"tolist": 1}  # the metrics and the gradient norm, all at once


def test_a_micro_batch_reaches_the_device_in_two_copies(monkeypatch):
    """Its integers and its floats, each one tensor (pinned and copied without waiting on CUDA); every field a slice."""
    from backends.training import packing
    from backends.training.token_rows import TrainingRow

    copies = []
    monkeypatch.setattr(packing, "to_device", lambda host, device: copies.append(host.dtype) or host.to(device))
    rows = [TrainingRow([1, 2, 3, 4], [False, True, False, True], [0.0, -0.5, 0.0, -0.25], advantage=1.5, weight=0.1),
            TrainingRow([5, 6, 7], [False, False, True], [0.0, 0.0, -1.0], advantage=-1.0, weight=0.2)]
    mb = packing.make_micro_batch(rows, "cpu")
    assert copies == [torch.long, torch.float32]
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7]] and mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert mb.pred_index.tolist() == [0, 2, 5] and mb.targets.tolist() == [2, 4, 7]
    assert mb.row_index.tolist() == [0, 0, 1]
    assert mb.sampler_logprobs.tolist() == [-0.5, -0.25, -1.0] and mb.advantages.tolist() == [1.5, 1.5, -1.0]
    assert mb.weights.tolist() == pytest.approx([0.1, 0.1, 0.2])
    assert mb.spans.lengths == (4, 3) and mb.spans.max_len == 4
    assert mb.spans.cu_seqlens.dtype == torch.int32 and mb.spans.cu_seqlens.tolist() == [0, 4, 7]


def test_each_micro_batch_is_packed_just_before_its_own_forward(tiny_model_path, monkeypatch):
    """The host packs micro-batch k+1 after launching micro-batch k's backward (the GPU still runs it), not all of them
    before the first kernel; with KL shaping the reference passes need every micro-batch first."""
    from backends.training import trainer as trainer_module

    for kl_coef in (0.0, 0.1):
        trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(micro_batch_tokens=8, kl_coef=kl_coef))
        order = []
        pack, step = trainer_module.make_micro_batch, trainer._micro_batch_step
        monkeypatch.setattr(trainer_module, "make_micro_batch", lambda *a: order.append("pack") or pack(*a))
        monkeypatch.setattr(trainer, "_micro_batch_step", lambda *a: order.append("step") or step(*a))
        n = int(trainer.train_step(GROUPS)["micro_batches"])
        assert n >= 3
        assert order == (["pack", "step"] * n if kl_coef == 0 else ["pack"] * n + ["step"] * n)
        monkeypatch.undo()


def test_the_step_is_the_same_update_as_the_plain_sequence(tiny_model_path):
    """Clipping before the metrics' read (one transfer for both) takes the same step as: every micro-batch's
    backward, the clipped gradient norm read on its own, AdamW."""
    cfg = TrainerConfig(micro_batch_tokens=8, grad_clip=1e-4, learning_rate=1e-3, max_row_tokens=64,
                        aggregation="sequence_mean", overlong="drop", scale_rewards=True)
    ours, plain = GRPOTrainer(str(tiny_model_path), cfg), GRPOTrainer(str(tiny_model_path), cfg)
    metrics = ours.train_step(GROUPS)

    eps, eps_high = cfg.clip_range()
    plain.model.train()
    plain.optimizer.zero_grad(set_to_none=True)
    with plain.lora_casts_scope():
        for mb in plain.micro_batches(step_rows(GROUPS)):
            plain._micro_batch_step(mb, eps, eps_high)
    norm = float(torch.nn.utils.clip_grad_norm_(plain.trainable_parameters, cfg.grad_clip))
    plain.optimizer.step()
    assert norm > cfg.grad_clip  # the clip bites
    assert metrics["grad_norm"] == norm
    for a, b in zip(ours.trainable_parameters, plain.trainable_parameters, strict=True):
        assert torch.equal(a, b)
