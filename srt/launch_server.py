"""`python -m srt.launch_server --model-path ...`: the HTTP server."""

from __future__ import annotations

import argparse
import sys

from srt.entrypoints.processes import start_subprocesses
from srt.server_args import ServerArgs
from srt.utils import configure_logger


def parse_args(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(
        prog="radixserve",
        description="radixserve HTTP server (SGLang-compatible)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        return ServerArgs.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> None:
    server_args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logger(server_args.log_level)
    # The workers start first: their imports (torch, the model) overlap this process's own (FastAPI,
    # the tokenizer), which only the HTTP server needs.
    launch = start_subprocesses(server_args)
    try:
        from srt.entrypoints.http_server import launch_server
    except BaseException:
        launch.subs.stop()
        raise
    launch_server(server_args, launch)


if __name__ == "__main__":
    main()
