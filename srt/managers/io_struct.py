"""Messages between the processes: the HTTP/Engine request shape, and what flows over ZMQ.

TokenizerManager -> Scheduler (through the DP controller with --dp-size > 1):
    TokenizedGenerateReqInput, AbortReq, FlushCacheReq, GetInternalStateReq, ProfileReq,
    LoadLoRAAdapterReq, UnloadLoRAAdapterReq.
Scheduler -> TokenizerManager, two paths into the same socket:
    - request outputs go through the detokenizer: Scheduler -> Detokenizer BatchTokenIDOutput,
      Detokenizer -> TokenizerManager BatchStrOutput. So does SchedulerCrashed, the scheduler's
      last words: it travels behind the outputs sent before it, so a request that finished before
      the crash still gets its final output, and every other request then fails with the reason.
    - pooling requests' answers go directly: BatchEmbeddingOutput (there is no text to detokenize).
    - control replies go directly: FlushCacheReqOutput, GetInternalStateReqOutput, ProfileReqOutput,
      LoRAUpdateOutput (one per data-parallel replica; they carry no request output, so their order
      against outputs does not matter).
Scheduler -> DP controller, directly: LoadReport.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from srt.managers.scheduler_state import SchedulerState
from srt.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from srt.models.multimodal import MultimodalItem

MAX_BATCH_SIZE = 2048  # prompts in one /generate call


class InvalidRequest(ValueError):
    """A client mistake in the request body; the HTTP layer answers 400 with this message."""


def _item(value, i: int, batch: bool):
    """Per-item value of a field that may be given once for the whole batch or as a list."""
    return value[i] if batch and isinstance(value, list) else value


# GenerateReqInput fields given once for the whole batch or as a list with one value per prompt
# (token_ids_logprob is a list either way: see GenerateReqInput._token_ids_per_prompt).
PER_PROMPT_FIELDS = (
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "priority",
    "extra_key",
    "timeout",
    "lora_path",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "session_params",
)


@dataclass
class GenerateReqInput:
    """The native /generate body (SGLang's shape). Exactly one of text / input_ids."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    # logprobs of these token ids at every position (one list for all prompts, or one per prompt)
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    priority: int | list[int] | None = None
    extra_key: str | list[str] | None = None
    timeout: float | list[float] | None = None  # seconds; past it the request is aborted
    data_parallel_rank: int | None = None  # pin to one --dp-size replica (SGLang's router sends it)
    # the LoRA adapter to run under, by name (--lora-paths, /load_lora_adapter), or one per prompt;
    # None: the base model
    lora_path: str | list[str | None] | None = None
    # prefill-decode disaggregation: the prefill server's bootstrap address and the request's room
    # (what SGLang's router adds; one per prompt in a batch)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    # sessions (srt/sessions): {"id", "rid", "offset", "replace", "drop_previous_output"}, or one per prompt
    session_params: dict | list[dict] | None = None
    # images (a vision-language model): for one prompt an image or a list of them, for a batch one
    # such entry per prompt; each a data URL, base64, a file path or an http(s) URL (SGLang's shape).
    # The prompt carries one image placeholder token per image, in order.
    image_data: Any = None
    # what error messages call each image (the chat API names its content parts); default image_data[i]
    media_labels: list[str] | None = None

    @classmethod
    def from_dict(cls, body: Any) -> GenerateReqInput:
        if not isinstance(body, dict):
            raise InvalidRequest("request body must be a JSON object")
        names = cls.__dataclass_fields__.keys() - {"media_labels"}  # set by the chat API, not by clients
        return cls(**{k: v for k, v in body.items() if k in names})

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text) if self.text is not None else len(self.input_ids or ())

    def validate(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequest("exactly one of `text` or `input_ids` must be given")
        if self.text is not None:
            ok = isinstance(self.text, str) or (
                isinstance(self.text, list) and self.text and all(isinstance(t, str) for t in self.text)
            )
            if not ok:
                raise InvalidRequest("`text` must be a string or a non-empty list of strings")
        else:
            ids = self.input_ids
            flat = isinstance(ids, list) and ids and all(_is_token(t) for t in ids)
            nested = (
                isinstance(ids, list)
                and ids
                and all(isinstance(x, list) and x and all(_is_token(t) for t in x) for x in ids)
            )
            if not (flat or nested):
                raise InvalidRequest("`input_ids` must be a non-empty list of token ids or a list of such lists")
        n = self.batch_size
        if n > MAX_BATCH_SIZE:
            raise InvalidRequest(f"the batch has {n} prompts, more than the limit of {MAX_BATCH_SIZE}")
        for name in PER_PROMPT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, list) and (not self.is_batch or len(v) != n):
                raise InvalidRequest(f"`{name}` is a list of {len(v)} but the request has {n} prompt(s)")
        if not isinstance(self.stream, bool):
            raise InvalidRequest(f"`stream` must be a boolean, got {self.stream!r}")
        if self.is_batch and self.image_data is not None:
            if not isinstance(self.image_data, list) or len(self.image_data) != n:
                raise InvalidRequest(f"`image_data` of a batch must be a list with one entry per prompt ({n})")
        ids = self.token_ids_logprob
        if self._token_ids_per_prompt and (not self.is_batch or len(ids or ()) != n):
            raise InvalidRequest(
                f"`token_ids_logprob` is a list of {len(ids or ())} lists but the request has {n} prompt(s)"
            )

    def item(self, i: int) -> GenerateReqInput:
        b = self.is_batch
        text, input_ids = self.text, self.input_ids
        if b:  # validate() checked that a batch's input_ids is a list of lists
            text = text[i] if text is not None else None
            input_ids = cast("list[list[int]]", input_ids)[i] if input_ids is not None else None
        per_prompt = {name: _item(getattr(self, name), i, b) for name in PER_PROMPT_FIELDS}
        images = self.image_data[i] if b and self.image_data is not None else self.image_data
        labels = self.media_labels
        if b and images is not None:
            labels = [
                f"image_data[{i}]" if not isinstance(images, list) else f"image_data[{i}][{j}]"
                for j in range(len(images) if isinstance(images, list) else 1)
            ]
        return replace(
            self,
            text=text,
            input_ids=input_ids,
            token_ids_logprob=self._token_ids_item(i),
            image_data=images,
            media_labels=labels,
            **per_prompt,
        )

    def images(self) -> tuple[list, list[str]]:
        """One prompt's images (an item of a batch, or a single request) and their labels."""
        if self.image_data is None:
            return [], []
        images = self.image_data if isinstance(self.image_data, list) else [self.image_data]
        labels = self.media_labels
        if labels is None or len(labels) != len(images):
            labels = (
                [f"image_data[{j}]" for j in range(len(images))]
                if isinstance(self.image_data, list)
                else ["image_data"]
            )
        return images, labels

    @property
    def _token_ids_per_prompt(self) -> bool:
        """`token_ids_logprob` holds one list per prompt (else one list for every prompt)."""
        ids = self.token_ids_logprob
        return isinstance(ids, list) and bool(ids) and all(isinstance(x, list) for x in ids)

    def _token_ids_item(self, i: int) -> list[int] | None:
        if self.is_batch and self._token_ids_per_prompt:
            return cast("list[list[int]]", self.token_ids_logprob)[i]
        return cast("list[int] | None", self.token_ids_logprob)


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def new_rid() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class BaseFinishReason(ABC):
    """Why a request ended. The scheduler sets it, the detokenizer and the tokenizer manager read
    it; `to_json()` is what the client sees as `meta_info.finish_reason`."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class FINISH_MATCHED_TOKEN(BaseFinishReason):
    """The last output token is a stop token (EOS, stop_token_ids) or completed the grammar."""

    matched: int

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass(frozen=True)
class FINISH_MATCHED_STR(BaseFinishReason):
    matched: str

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass(frozen=True)
class FINISHED_MATCHED_REGEX(BaseFinishReason):
    """The output's tail matched one of sampling_params.stop_regex (SGLang's name); `matched` is the pattern."""

    matched: str

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass(frozen=True)
class FINISH_LENGTH(BaseFinishReason):
    """max_new_tokens reached, or the context length."""

    length: int

    def to_json(self) -> dict[str, Any]:
        return {"type": "length", "length": self.length}


@dataclass(frozen=True)
class FINISH_ABORT(BaseFinishReason):
    """status_code 400: the request itself was bad (e.g. its grammar does not compile); the
    tokenizer manager answers it with an HTTP 400 when nothing was generated."""

    message: str
    status_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        reason: dict[str, Any] = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            reason["status_code"] = self.status_code
        return reason


class DecodeSettings(NamedTuple):
    """How the detokenizer turns a request's ids into text."""

    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stop_strs: tuple[str, ...]
    no_stop_trim: bool
    stop_regex: tuple[str, ...] = ()  # sampling_params.stop_regex: text a match may still start in is held back


@dataclass(kw_only=True)
class TokenizedGenerateReqInput:
    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None = None
    stream: bool
    priority: int | None = None
    tenant: str | None = None  # the server-side tenant (API key or --tenant-header), for fair shares
    extra_key: str | None = None
    # sessions (srt/sessions): the session, and the request of it this one continues
    session_id: str | None = None
    session_parent: str | None = None
    session_replace: bool = False  # it replaces the branches that grew from session_parent
    created_time: float = 0.0
    timeout: float | None = None
    data_parallel_rank: int | None = None
    lora_name: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # images: one item per image, its rows' pad values in input_ids (srt/models/multimodal.py)
    mm_items: list[MultimodalItem] | None = None
    # pooling (srt/pooling): answer with the input's embedding (or a classifier's logits) in a
    # BatchEmbeddingOutput instead of tokens; BERT's segment ids of a cross-encoder's pair
    pooling: bool = False
    token_type_ids: list[int] | None = None


@dataclass(kw_only=True)
class BatchEmbeddingOutput:
    """Finished pooling requests, straight from the scheduler to the tokenizer manager: each one's
    embedding (or logits) as float32, its prompt tokens and those found in the prefix cache."""

    rids: list[str]
    embeddings: list[Any]  # numpy float32 vectors
    prompt_tokens: list[int]
    cached_tokens: list[int]


@dataclass(kw_only=True)
class AbortReq:
    rid: str = ""
    abort_all: bool = False
    message: str = "aborted"


@dataclass(kw_only=True)
class SchedulerCrashed:
    """The scheduler's last words before it exits on an exception."""

    message: str


# Control requests go to every data-parallel replica and each one answers. A reply carries its
# request's rid, so a reply that comes after its call timed out is dropped, not taken by the next call.


@dataclass(kw_only=True)
class FlushCacheReq:
    rid: str = field(default_factory=new_rid)
    storage: bool = False  # clear the hierarchical cache's storage tier instead (L1 and L2 stay)


@dataclass(kw_only=True)
class FlushCacheReqOutput:
    rid: str
    success: bool
    message: str = ""


@dataclass(kw_only=True)
class CloseSessionReq:
    """Release what an open session keeps in the prefix cache (srt/sessions)."""

    rid: str = field(default_factory=new_rid)
    session_id: str


@dataclass(kw_only=True)
class CloseSessionReqOutput:
    rid: str
    success: bool
    message: str = ""


@dataclass(kw_only=True)
class GetInternalStateReq:
    rid: str = field(default_factory=new_rid)


@dataclass(kw_only=True)
class GetInternalStateReqOutput:
    rid: str
    state: SchedulerState


@dataclass(kw_only=True)
class LoadLoRAAdapterReq:
    """/load_lora_adapter: register an adapter (every data-parallel replica loads it)."""

    rid: str = field(default_factory=new_rid)
    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass(kw_only=True)
class UnloadLoRAAdapterReq:
    """/unload_lora_adapter: answered once the adapter's queued and running requests have finished."""

    rid: str = field(default_factory=new_rid)
    lora_name: str


@dataclass(kw_only=True)
class LoRAUpdateOutput:
    rid: str
    success: bool
    message: str = ""
    loaded_adapters: dict[str, str] = field(default_factory=dict)  # name -> path, after the update

    def to_json(self) -> dict[str, Any]:
        """SGLang's reply shape (/load_lora_adapter, /unload_lora_adapter, the Engine's methods)."""
        return {"success": self.success, "error_message": self.message or None, "loaded_adapters": self.loaded_adapters}


@dataclass(kw_only=True)
class WeightsReq:
    """A call on the served weights or on generation itself (srt/rl): `op` is its route's name
    (update_weights_from_disk, update_weights_from_tensor, get_weights_by_name, pause_generation,
    continue_generation, release_memory_occupation, ...) and `args` its body."""

    rid: str = field(default_factory=new_rid)
    op: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class WeightsReqOutput:
    rid: str
    success: bool
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)  # the call's answer (weight_version, a parameter, ...)


@dataclass(kw_only=True)
class ProfileReq:
    """/start_profile (`start=True`, with SGLang's ProfileReqInput fields) or /stop_profile."""

    rid: str = field(default_factory=new_rid)
    start: bool = True
    output_dir: str = ""
    profile_id: str = ""
    start_step: int | None = None  # the scheduler's forward pass to start at (absolute, like SGLang's)
    num_steps: int | None = None  # stop by itself after this many forward passes
    activities: tuple[str, ...] = ("CPU",)
    with_stack: bool = False
    record_shapes: bool = False


@dataclass(kw_only=True)
class ProfileReqOutput:
    rid: str
    success: bool
    message: str = ""
    traces: list[str] = field(default_factory=list)  # files written (on stop)


@dataclass(kw_only=True)
class LoadReport:
    """A data-parallel replica's load, sent to the controller whenever it changes."""

    dp_rank: int
    num_reqs: int  # running + waiting
    num_waiting_reqs: int
    num_used_tokens: int  # KV slots held by requests (not evictable cache)
    num_received: int  # requests it has received so far


@dataclass(kw_only=True)
class BatchTokenIDOutput:
    """New tokens of the requests that made progress this step (deltas since the last send)."""

    rids: list[str] = field(default_factory=list)
    finished_reasons: list[BaseFinishReason | None] = field(default_factory=list)
    new_output_ids: list[list[int]] = field(default_factory=list)
    # the detokenizer reads them from a request's first output
    decode_settings: list[DecodeSettings] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    cached_tokens_details: list[tuple[int, int, int]] = field(default_factory=list)  # (device, host, storage)
    retractions: list[int] = field(default_factory=list)
    # logprob deltas, each a list per request (empty when not requested)
    input_token_logprobs: list[list] = field(default_factory=list)
    input_top_logprobs: list[list] = field(default_factory=list)
    output_token_logprobs: list[list] = field(default_factory=list)
    output_top_logprobs: list[list] = field(default_factory=list)
    # token_ids_logprob: per position (logprobs, ids) of the asked ids, or None (first prompt token)
    input_token_ids_logprobs: list[list] = field(default_factory=list)
    output_token_ids_logprobs: list[list] = field(default_factory=list)
    dp_rank: int = 0  # the data-parallel replica whose scheduler sent it
    # speculative servers: per request (drafts proposed, steps by accepted drafts: Req.spec_histogram)
    spec: list[tuple[int, list[int]]] = field(default_factory=list)
    # per request: meta_info set by a component since the last output (Req.meta), else None
    meta: list[dict | None] = field(default_factory=list)


@dataclass(kw_only=True)
class BatchStrOutput:
    """A BatchTokenIDOutput passed on with its text: the detokenizer adds each request's text delta
    and forwards the token output itself, so a new output field is declared only there."""

    token_output: BatchTokenIDOutput
    text_deltas: list[str]
