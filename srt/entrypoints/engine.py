"""`srt.Engine`: the runtime in-process, without HTTP.

The same scheduler and detokenizer processes as the server; the TokenizerManager runs on an event
loop in a background thread, so `generate` works from plain scripts, threads and notebooks alike,
and `async_generate` from any running event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, TypedDict

import uvloop

from srt.configs.model_config import load_hf_config
from srt.entrypoints.pooling import PoolingServing
from srt.entrypoints.processes import launch_subprocesses
from srt.lora.adapter import LoRARef
from srt.managers.io_struct import GenerateReqInput, WeightsReqOutput
from srt.managers.tokenizer_manager import TokenizerManager
from srt.rl import serialization
from srt.server_args import ServerArgs
from srt.utils import configure_logger
from srt.version import __version__

if TYPE_CHECKING:
    from typing_extensions import Unpack

_END = object()


class GenerateArgs(TypedDict, total=False):
    """The keywords of `generate` and `async_generate` after `prompt` and `sampling_params`: the
    GenerateReqInput fields of the same names (see POST /generate)."""

    input_ids: list[int] | list[list[int]] | None
    return_logprob: bool | list[bool]
    logprob_start_len: int | list[int]
    top_logprobs_num: int | list[int]
    token_ids_logprob: list[int] | list[list[int]] | None
    return_text_in_logprobs: bool
    stream: bool
    rid: str | list[str] | None
    priority: int | list[int] | None
    bootstrap_host: str | list[str] | None
    bootstrap_port: int | list[int] | None
    bootstrap_room: int | list[int] | None
    lora_path: str | list[str | None] | None
    # a vision-language model's images: per prompt one or a list, each a data URL, base64, a file
    # path, an http(s) URL (--allow-remote-media), raw bytes or a PIL image
    image_data: Any


def generate_request(
    method: str, prompt: str | list[str] | None, sampling_params: dict | list[dict] | None, kwargs: GenerateArgs
) -> GenerateReqInput:
    """The one builder of both methods' request; a keyword outside GenerateArgs is a TypeError, as
    for any other Python call (GenerateReqInput has more fields than the Engine takes)."""
    unknown = sorted(kwargs.keys() - GenerateArgs.__optional_keys__)
    if unknown:
        raise TypeError(f"Engine.{method}() got an unexpected keyword argument {unknown[0]!r}")
    return GenerateReqInput(text=prompt, sampling_params=sampling_params, **kwargs)


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any):
        self.server_args = ServerArgs(model_path=model_path, **kwargs)
        configure_logger(self.server_args.log_level)
        self._subs = launch_subprocesses(self.server_args)
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="radixserve-engine", daemon=True)
        self._thread.start()
        assert self._subs.port_args is not None, "launch_subprocesses returns with the workers' ports"
        self.tokenizer_manager = TokenizerManager(self.server_args, self._subs.port_args, self._subs.scheduler_info)
        self._run(self._start())
        tm = self.tokenizer_manager
        self._subs.watch(
            lambda reason: self._loop.call_soon_threadsafe(tm.fail_all, reason),
            settled=lambda: tm.dead_reason is not None,
        )
        self._closed = False
        model_path = self.server_args.model_path
        assert model_path is not None
        self.pooling = PoolingServing.of(
            tm, self.server_args.served_model_name or model_path, load_hf_config(model_path)
        )

    async def _start(self) -> None:
        self.tokenizer_manager.start()

    def _submit(self, coro) -> concurrent.futures.Future:
        """Runs coro on the engine's loop; after shutdown (no loop, no workers) a RuntimeError."""
        if getattr(self, "_closed", False):  # (not yet set while __init__ starts the loop)
            coro.close()
            raise RuntimeError("the Engine is shut down: make a new Engine to generate again")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro):
        return self._submit(coro).result()

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        **kwargs: Unpack[GenerateArgs],
    ) -> dict | list[dict] | Iterator[dict]:
        """Same arguments and outputs as POST /generate. With stream=True, an iterator of chunks."""
        obj = generate_request("generate", prompt, sampling_params, kwargs)
        if not obj.stream:
            return self._run(self._first(obj))
        return self._iterate(obj)

    async def _first(self, obj: GenerateReqInput):
        gen = self.tokenizer_manager.generate_request(obj)
        try:
            return await gen.__anext__()
        finally:
            await gen.aclose()

    def _iterate(self, obj: GenerateReqInput) -> Iterator[dict]:
        q: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                async for out in self.tokenizer_manager.generate_request(obj):
                    q.put(out)
            except BaseException as e:  # surfaced in the caller's thread
                q.put(e)
            q.put(_END)

        future = self._submit(pump())
        try:
            while (item := q.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        **kwargs: Unpack[GenerateArgs],
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """Awaitable result, or (stream=True) an async iterator of chunks, on the caller's loop."""
        obj = generate_request("async_generate", prompt, sampling_params, kwargs)
        if not obj.stream:
            return await asyncio.wrap_future(self._submit(self._first(obj)))
        return self._aiterate(obj)

    async def _aiterate(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        caller = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for out in self.tokenizer_manager.generate_request(obj):
                    caller.call_soon_threadsafe(q.put_nowait, out)
            except BaseException as e:
                caller.call_soon_threadsafe(q.put_nowait, e)
            caller.call_soon_threadsafe(q.put_nowait, _END)

        future = self._submit(pump())
        try:
            while (item := await q.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    def encode(
        self,
        prompt: str | list[str] | list[int] | list[list[int]],
        dimensions: int | None = None,
        truncate: bool = False,
    ) -> dict | list[dict]:
        """Embeddings (or a classifier's logits) as POST /encode answers: {"embedding", "meta_info"},
        a list for a list of prompts. Text, or token ids."""
        ids = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], str)
        body = {"input_ids" if ids else "text": prompt, "dimensions": dimensions, "truncate": truncate}
        return self._run(self.pooling.encode(body))

    def rerank(
        self, query: str, documents: list[str], top_n: int | None = None, return_documents: bool = True
    ) -> list[dict]:
        """Documents by relevance to the query, best first, as POST /v1/rerank answers (SGLang's list)."""
        body = {"query": query, "documents": documents, "top_n": top_n, "return_documents": return_documents}
        return self._run(self.pooling.rerank(body))

    def score(
        self,
        query: str | list[int],
        items: list[str] | list[list[int]],
        label_token_ids: list[int],
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:
        """SGLang's Engine.score: per item, the probabilities of label_token_ids as the next token."""
        body = {
            "query": query,
            "items": items,
            "label_token_ids": label_token_ids,
            "apply_softmax": apply_softmax,
            "item_first": item_first,
        }
        return self._run(self.pooling.score(body))["scores"]

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """Register a LoRA adapter (POST /load_lora_adapter): {success, error_message, loaded_adapters}."""
        return self._run(self.tokenizer_manager.load_lora_adapter(LoRARef(lora_name, lora_path, pinned))).to_json()

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Unregister a LoRA adapter once its requests have finished (POST /unload_lora_adapter)."""
        return self._run(self.tokenizer_manager.unload_lora_adapter(lora_name)).to_json()

    def flush_cache(self) -> bool:
        return self._run(self.tokenizer_manager.flush_cache()).success

    # -- reinforcement-learning rollouts (srt/rl, docs/rl.md) ---------------------------------------

    def _weights(self, op: str, **args: Any) -> WeightsReqOutput:
        args = {k: v for k, v in args.items() if v is not None}
        return self._run(self.tokenizer_manager.weights_control(op, args))

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> tuple[bool, str]:
        """Load a checkpoint of the same model in place of the served weights: (success, message)."""
        out = self._weights(
            "update_weights_from_disk",
            model_path=model_path,
            load_format=load_format,
            weight_version=weight_version,
            abort_all_requests=abort_all_requests,
            flush_cache=flush_cache,
        )
        return out.success, out.message

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, Any]],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str]:
        """Replace these checkpoint tensors (any subset, HF names): (success, message). The tensors
        reach the scheduler processes through shared memory, not copied through a socket."""
        payloads = [serialization.dumps(list(named_tensors)) for _ in range(self.server_args.tp_size)]
        out = self._weights(
            "update_weights_from_tensor",
            serialized_named_tensors=payloads,
            load_format=load_format,
            flush_cache=flush_cache,
            weight_version=weight_version,
            abort_all_requests=abort_all_requests,
        )
        return out.success, out.message

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str | None = None,
    ) -> tuple[bool, str]:
        out = self._weights(
            "init_weights_update_group",
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        return out.success, out.message

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> tuple[bool, str]:
        out = self._weights(
            "update_weights_from_distributed",
            names=names,
            dtypes=[str(d).removeprefix("torch.") for d in dtypes],
            shapes=[list(s) for s in shapes],
            group_name=group_name,
            flush_cache=flush_cache,
            weight_version=weight_version,
        )
        return out.success, out.message

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        out = self._weights("destroy_weights_update_group", group_name=group_name)
        return out.success, out.message

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        out = self._weights("get_weights_by_name", name=name, truncate_size=truncate_size)
        if not out.success:
            raise ValueError(out.message)
        return out.data["parameter"]

    def get_weight_version(self) -> str:
        return self._weights("get_weight_version").data["weight_version"]

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> tuple[bool, str]:
        out = self._weights("update_weight_version", new_version=new_version, abort_all_requests=abort_all_requests)
        return out.success, out.message

    def pause_generation(self, mode: str = "abort") -> None:
        out = self._weights("pause_generation", mode=mode)
        if not out.success:
            raise ValueError(out.message)

    def continue_generation(self) -> None:
        self._weights("continue_generation")

    def release_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        out = self._weights("release_memory_occupation", tags=tags)
        return out.success, out.message

    def resume_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        out = self._weights("resume_memory_occupation", tags=tags)
        return out.success, out.message

    def clear_hicache_storage(self) -> bool:
        """Delete the hierarchical cache's stored pages (--hicache-storage-backend)."""
        return self._run(self.tokenizer_manager.flush_cache(storage=True)).success

    def get_server_info(self) -> dict:
        states = self._run(self.tokenizer_manager.get_internal_states())
        return {
            **self.server_args.public_dict(),
            **self._subs.scheduler_info,
            "max_req_input_len": self.tokenizer_manager.max_req_input_len,
            "version": __version__,
            "internal_states": [st.to_json() for st in states],
        }

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._subs.stop()
        task = self.tokenizer_manager.handle_loop_task

        async def stop_receiving(task: asyncio.Task) -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        if task is not None:
            asyncio.run_coroutine_threadsafe(stop_receiving(task), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self.tokenizer_manager.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
