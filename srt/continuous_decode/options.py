"""--num-continuous-decode-steps's start-up check."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from srt.server_args import ServerArgs


def check_continuous_decode_server_args(server_args: ServerArgs) -> None:
    steps = server_args.num_continuous_decode_steps
    if steps > 1 and server_args.speculative_algorithm is not None:
        raise ValueError(
            f"--num-continuous-decode-steps {steps} and --speculative-algorithm "
            f"{server_args.speculative_algorithm} both decide how a decode step runs: use one of them"
        )
