"""The LoRA option group's start-up checks; fills the values that default from --lora-paths."""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.configs.runtime_choices import resolve_device

if TYPE_CHECKING:
    from srt.server_args import ServerArgs


def check_lora_server_args(server_args: ServerArgs) -> None:
    if server_args.lora_paths and not server_args.enable_lora:
        server_args.enable_lora = True  # as SGLang: adapters named at start-up turn LoRA on
    if not server_args.enable_lora:
        return
    # the adapter code brings torch: imported only when LoRA is on
    from srt.lora.adapter import TARGET_MODULES, LoRAError, adapter_rank_and_modules, parse_lora_paths
    from srt.lora.backend import check_lora_backend

    try:
        refs = parse_lora_paths(server_args.lora_paths)
        shapes = [adapter_rank_and_modules(r.path) for r in refs]
    except LoRAError as e:
        raise ValueError(str(e)) from None
    if not 1 <= server_args.max_loras_per_batch <= 64:
        raise ValueError(f"--max-loras-per-batch must be in [1, 64], got {server_args.max_loras_per_batch}")
    if server_args.max_loaded_loras is None:
        server_args.max_loaded_loras = max(server_args.max_loras_per_batch, len(refs))
    if server_args.max_loaded_loras < server_args.max_loras_per_batch:
        raise ValueError(
            f"--max-loaded-loras ({server_args.max_loaded_loras}) must be >= --max-loras-per-batch "
            f"({server_args.max_loras_per_batch}): a batch's adapters must fit in the pool together"
        )
    pinned = sum(r.pinned for r in refs)
    if pinned and pinned >= server_args.max_loaded_loras:
        raise ValueError(
            f"--lora-paths pins {pinned} adapters; --max-loaded-loras {server_args.max_loaded_loras} must leave "
            f"a slot for unpinned ones"
        )
    if server_args.max_lora_rank is None:
        server_args.max_lora_rank = max((rank for rank, _ in shapes), default=16)
    if not 1 <= server_args.max_lora_rank <= 1024:
        raise ValueError(f"--max-lora-rank must be in [1, 1024], got {server_args.max_lora_rank}")
    over = [(r.name, rank) for r, (rank, _) in zip(refs, shapes) if rank > server_args.max_lora_rank]
    if over:
        raise ValueError(f"--lora-paths adapter {over[0][0]!r} has rank {over[0][1]} > --max-lora-rank")
    if server_args.lora_target_modules is None:
        targets = set().union(*(m for _, m in shapes)) if refs else set(TARGET_MODULES)
        server_args.lora_target_modules = sorted(targets, key=TARGET_MODULES.index)
    elif "all" in server_args.lora_target_modules:
        server_args.lora_target_modules = list(TARGET_MODULES)
    bad = [m for m in server_args.lora_target_modules if m not in TARGET_MODULES]
    if bad:
        raise ValueError(
            f"--lora-target-modules {bad[0]!r} is not supported; choose from {', '.join(TARGET_MODULES)} or all"
        )
    check_lora_backend(server_args.lora_backend, resolve_device(server_args.device))
    if server_args.speculative_algorithm is not None:
        raise ValueError("--enable-lora does not combine with --speculative-algorithm yet")
    if server_args.disaggregation_mode != "null":
        raise ValueError("--enable-lora does not combine with --disaggregation-mode yet")
