"""`EngineBackend`: programs run on an in-process `srt.Engine`, no HTTP in between."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from frontend.backends.base import Backend, BackendError

_ENGINE_ARGS = (
    "sampling_params",
    "input_ids",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
    "rid",
    "priority",
    "image_data",
)


class EngineBackend(Backend):
    def __init__(self, engine=None, chat_template: str | None = None, **engine_kwargs):
        """Wrap an existing `srt.Engine`, or start one with `engine_kwargs` (then `shutdown()` stops it)."""
        if engine is None:
            from srt.entrypoints.engine import Engine

            engine = Engine(**engine_kwargs)
            self._owned = True
        else:
            self._owned = False
        self.engine = engine
        self.chat_template_override = chat_template

    def __repr__(self) -> str:
        return f"EngineBackend({self.engine.server_args.model_path!r})"

    def model_info(self) -> dict:
        tm = self.engine.tokenizer_manager
        tok = tm.tokenizer
        return {
            "model_path": self.engine.server_args.model_path,
            "chat_template": getattr(tok, "chat_template", None),
            "bos_token": getattr(tok, "bos_token", None),
            "eos_token": getattr(tok, "eos_token", None),
            "tool_call_parser": self.engine.server_args.tool_call_parser,
            "image_token": tm.image_prompts.processor.placeholder() if tm.image_prompts is not None else None,
        }

    def _kwargs(self, body: dict) -> dict:
        kwargs = {k: body[k] for k in _ENGINE_ARGS if k in body}
        return {"prompt": body.get("text"), **kwargs}

    def call(self, body: dict) -> Any:
        try:
            return self.engine.generate(**self._kwargs(body))
        except (ValueError, RuntimeError) as e:
            raise _backend_error(e) from e

    def call_stream(self, body: dict) -> Iterator[dict]:
        try:
            yield from self.engine.generate(**self._kwargs(body))
        except (ValueError, RuntimeError) as e:
            raise _backend_error(e) from e

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def get_server_info(self) -> dict:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        if self._owned:
            self.engine.shutdown()


def _backend_error(e: Exception) -> BackendError:
    """The engine raises what the HTTP server turns into 400 (ValueError: invalid request) or 503."""
    return BackendError(str(e), 400 if isinstance(e, ValueError) else 503)
