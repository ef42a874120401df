"""--num-continuous-decode-steps' and --num-unstreamed-decode-steps' start-up check."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from srt.server_args import ServerArgs


def check_continuous_decode_server_args(server_args: ServerArgs) -> None:
    for flag, steps in (
        ("--num-continuous-decode-steps", server_args.num_continuous_decode_steps),
        ("--num-unstreamed-decode-steps", server_args.num_unstreamed_decode_steps or 1),
    ):
        if steps > 1 and server_args.speculative_algorithm is not None:
            raise ValueError(
                f"{flag} {steps} and --speculative-algorithm "
                f"{server_args.speculative_algorithm} both decide how a decode step runs: use one of them"
            )
