"""One rank's LoRA memory pool and the LoRA layers that read it.

The pool holds `slots` adapters at once (--max-loaded-loras), preallocated at start-up for rank
--max-lora-rank and the --lora-target-modules (float32 for the C++ backend, else the model's dtype),
sharded like the base layers. B is stored transposed (Bt):

- column-parallel projections (q/k/v fused as qkv_proj, gate/up fused as gate_up_proj): A is
  replicated, [slots, P * R, in]: part p's A in rows [p * R, p * R + r); Bt holds this rank's output
  columns, [slots, P * R, out_rank], part p's in its own row block, so one GEMM of each covers
  every part (zeros elsewhere);
- row-parallel projections (o_proj, down_proj): A holds this rank's input columns [slots, R, in_rank]
  (x @ A.T is a partial sum, all-reduced before the expand), Bt is replicated [slots, R, out].

Adapters of rank r < R leave the rest of their slot zero. B carries the adapter's scaling. The
scheduler (rank 0, srt/lora/registry.py) decides which adapter lives in which slot; every rank loads
the same adapter into the same slot, so a batch's slot numbers mean the same everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from srt.distributed import tensor_model_parallel_all_reduce
from srt.layers.linear import LinearBase, QKVParallelLinear
from srt.lora.adapter import BaseShape, LoRAAdapter, load_adapter
from srt.lora.backend import LoRABatchInfo, make_backend

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch
    from srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# fused layer attribute -> (its parent in the decoder layer, PEFT modules in part order, shard ids)
FUSED_TARGETS = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj"), ("q", "k", "v")),
    "o_proj": ("self_attn", ("o_proj",), (None,)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj"), (0, 1)),
    "down_proj": ("mlp", ("down_proj",), (None,)),
}
ROW_PARALLEL = ("o_proj", "down_proj")


class LoRALinear:
    """A linear layer's LoRA: the layer calls it on its input and base output (`layer.lora`)."""

    def __init__(
        self,
        manager: LoRAManager,
        layer: LinearBase,
        A: torch.Tensor,
        Bt: torch.Tensor,
        row_parallel: bool,
        parts: list[int],
    ):
        self.manager, self.layer = manager, layer
        self.A, self.Bt = A, Bt
        self.row_parallel = row_parallel
        self.parts = parts  # this rank's output features of each fused part (their ranks: K / len(parts) each)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        info = self.manager.batch
        if info is None:
            return out
        backend = self.manager.backend
        if self.row_parallel and self.manager.tp_size > 1:
            xa = tensor_model_parallel_all_reduce(backend.shrink(x, self.A, info))
            backend.expand(xa, self.Bt, info, out, self.parts)
        else:
            backend.apply(x, self.A, self.Bt, info, out, self.parts)
        return out


def build_lora_manager(runner: ModelRunner, cpu_ops) -> LoRAManager | None:
    """The runner's adapter pool with --enable-lora, else None (the runner's `build_lora`)."""
    args = runner.server_args
    if not args.enable_lora:
        return None
    assert args.max_loaded_loras is not None and args.max_lora_rank is not None
    return LoRAManager(
        runner.model,
        runner.model_config.hf_config,
        args.max_loaded_loras,
        args.max_lora_rank,
        frozenset(args.lora_target_modules or ()),
        args.lora_backend,
        runner.dtype,
        runner.device,
        runner.tp_size,
        cpu_ops,
    )


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        hf_config,
        slots: int,
        max_rank: int,
        targets: frozenset[str],
        backend: str,
        dtype: torch.dtype,
        device,
        tp_size: int,
        cpu_ops=None,
    ):
        self.base = BaseShape.from_hf_config(hf_config)
        self.slots, self.max_rank, self.targets = slots, max_rank, targets
        self.backend = make_backend(backend, device, cpu_ops)
        dtype = self.backend.pool_dtype or dtype
        self.tp_size = tp_size
        self.batch: LoRABatchInfo | None = None
        self.device = device
        self.layers: list[dict[str, LoRALinear]] = []  # per decoder layer: fused attribute -> its LoRA
        R = max_rank
        decoder_layers: Iterable[nn.Module] = model.model.layers  # pyright: ignore
        for decoder in decoder_layers:
            per_layer = {}
            for attr, (parent, modules, _) in FUSED_TARGETS.items():
                if not targets & set(modules):
                    continue
                layer: LinearBase = getattr(getattr(decoder, parent), attr)
                P = len(modules)  # row-parallel projections are single: K = R
                A = torch.zeros(slots, P * R, layer.input_size_per_partition, dtype=dtype, device=device)
                Bt = torch.zeros(slots, P * R, layer.output_size_per_partition, dtype=dtype, device=device)
                if isinstance(layer, QKVParallelLinear):
                    parts = [layer.q_size, layer.kv_size, layer.kv_size]
                else:
                    parts = [layer.output_size_per_partition // P] * P
                lora = LoRALinear(self, layer, A, Bt, attr in ROW_PARALLEL, parts)
                layer.lora = lora
                per_layer[attr] = lora
            self.layers.append(per_layer)
        self.pool_bytes = sum(
            (m.A.numel() + m.Bt.numel()) * m.A.element_size() for per in self.layers for m in per.values()
        )
        logger.info(
            "LoRA pool: %d adapter slots, rank <= %d, targets %s, %.1f MiB, backend %s",
            slots,
            max_rank,
            ",".join(sorted(targets)),
            self.pool_bytes / 2**20,
            self.backend.name,
        )

    def read(self, path: str) -> LoRAAdapter:
        """An adapter folder, checked against this pool (its base model, rank and targets)."""
        return load_adapter(path, self.base, self.max_rank, self.targets)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter (checked against this pool: srt/lora/adapter.py load_adapter) into a slot."""
        R = self.max_rank
        for i, per_layer in enumerate(self.layers):
            for attr, lora in per_layer.items():
                _, modules, shard_ids = FUSED_TARGETS[attr]
                lora.A[slot].zero_()
                lora.Bt[slot].zero_()
                for p, (module, shard) in enumerate(zip(modules, shard_ids)):
                    w = adapter.weights.get((i, module))
                    if w is None:
                        continue
                    a, b = w
                    r = a.shape[0]
                    if lora.row_parallel:
                        (piece,) = lora.layer.pieces(b.shape[0], None)
                        assert piece.cols is not None, "row-parallel layers split their input columns"
                        offset, size = piece.cols
                        lora.A[slot, :r].copy_(a[:, offset : offset + size])
                        lora.Bt[slot, :r].copy_(b.t())
                    else:
                        lora.A[slot, p * R : p * R + r].copy_(a)
                        for piece in lora.layer.pieces(b.shape[0], shard):
                            rows = b[piece.src_row : piece.src_row + piece.rows]
                            lora.Bt[slot, p * R : p * R + r, piece.dst_row : piece.dst_row + piece.rows].copy_(rows.t())

    def begin(self, fb: ForwardBatch) -> bool:
        """Set the segments of the forward pass about to run; False (nothing set) when no row of it
        uses an adapter."""
        self.batch = None
        if fb.lora_slots_cpu is not None:
            rows = fb.extend_seq_lens_cpu if fb.extend_seq_lens_cpu is not None else [1] * fb.batch_size
            self.batch = LoRABatchInfo.build(fb.lora_slots_cpu, rows, self.device)
        return self.batch is not None

    def end(self) -> None:
        self.batch = None
