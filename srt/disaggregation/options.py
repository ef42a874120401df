"""The prefill-decode disaggregation option group's start-up checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from srt.server_args import ServerArgs


def check_disaggregation_server_args(server_args: ServerArgs) -> None:
    if server_args.disaggregation_mode == "null":
        return
    mode = f"--disaggregation-mode {server_args.disaggregation_mode}"
    if server_args.dp_size > 1 or server_args.nnodes > 1:
        raise ValueError(f"{mode} runs one replica on one node (--dp-size 1, --nnodes 1); start more servers instead")
    if server_args.speculative_algorithm is not None:
        raise ValueError(f"{mode} does not combine with --speculative-algorithm")
    if server_args.disaggregation_transfer_backend == "mooncake":
        from srt.disaggregation.transfer import mooncake_engine_class  # brings torch: only when PD is on

        mooncake_engine_class()
