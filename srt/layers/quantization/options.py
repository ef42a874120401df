"""The weight and KV cache quantization options' start-up checks; applies --torchao-config."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from srt.configs.runtime_choices import INT4_GROUP_SIZES

if TYPE_CHECKING:
    from srt.server_args import ServerArgs


def check_quantization_server_args(server_args: ServerArgs) -> None:
    if server_args.torchao_config is not None:
        _apply_torchao_config(server_args, server_args.torchao_config)
    if server_args.quantization_group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"--quantization-group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}; "
            f"got {server_args.quantization_group_size}"
        )
    path = server_args.quantization_param_path
    if path is not None:
        if not server_args.kv_cache_dtype.startswith("fp8"):
            raise ValueError(
                "--quantization-param-path holds fp8 KV cache scales; it needs --kv-cache-dtype fp8_e4m3 or "
                f"fp8_e5m2, got {server_args.kv_cache_dtype}"
            )
        if not os.path.isfile(path):
            raise ValueError(f"--quantization-param-path {path!r} is not a file")


def _apply_torchao_config(server_args: ServerArgs, name: str) -> None:
    """SGLang's int4wo-<group size> is --quantization int4_weight_only --quantization-group-size N."""
    group = name.removeprefix("int4wo-")
    if not name.startswith("int4wo-") or not group.isdigit() or int(group) not in INT4_GROUP_SIZES:
        raise ValueError(
            f"--torchao-config supports int4wo-<group size> with a group size in "
            f"{', '.join(map(str, INT4_GROUP_SIZES))}; got {name!r} (for int8 use --quantization w8a8_int8)"
        )
    if server_args.quantization not in (None, "int4_weight_only"):
        raise ValueError(f"--torchao-config {name} contradicts --quantization {server_args.quantization}")
    server_args.quantization = "int4_weight_only"
    server_args.quantization_group_size = int(group)
