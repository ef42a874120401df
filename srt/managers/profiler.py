"""/start_profile and /stop_profile: torch profiler traces of the forward passes.

Each data-parallel replica's scheduler (tensor-parallel rank 0) drives its own profiler and tells
its tensor-parallel followers when it starts and stops (through the forward broadcast), so every
rank writes `{profile_id}-TP-{tp}[-DP-{dp}].trace.json.gz` (Chrome / Perfetto trace format) into
the output folder. The scheduler thread and the overlap worker thread are both recorded."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity

from srt.managers.io_struct import ProfileReq, ProfileReqOutput

logger = logging.getLogger(__name__)

# SGLang's activity names; "GPU" records CUDA kernels, "MEM" tensor allocations.
PROFILE_ACTIVITIES = ("CPU", "GPU", "MEM")


def default_profile_dir(configured: str | None) -> str:
    return configured or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or "/tmp"


class ForwardProfiler:
    def __init__(self, tp_rank: int, dp_rank: int, dp_size: int, tell_followers: Callable[[ProfileReq], None] | None):
        self.suffix = f"-TP-{tp_rank}" + (f"-DP-{dp_rank}" if dp_size > 1 else "")
        self.tell_followers = tell_followers
        self.req: ProfileReq | None = None  # the running (or, before its start_step, pending) profile
        self.profiler: torch.profiler.profile | None = None
        self.steps_done = 0

    def handle(self, req: ProfileReq, step: int) -> ProfileReqOutput:
        """A start or stop request, at the scheduler's forward pass count `step`."""
        if req.start:
            if self.req is not None:
                return ProfileReqOutput(
                    rid=req.rid, success=False, message="profiling is already in progress; call /stop_profile first"
                )
            try:
                os.makedirs(req.output_dir, exist_ok=True)
            except OSError as e:
                return ProfileReqOutput(rid=req.rid, success=False, message=f"output_dir {req.output_dir!r}: {e}")
            self.req = req
            if req.start_step is None or req.start_step <= step:
                self._begin()
            return ProfileReqOutput(rid=req.rid, success=True)
        if self.req is None:
            return ProfileReqOutput(
                rid=req.rid, success=False, message="profiling is not in progress; call /start_profile first"
            )
        return ProfileReqOutput(rid=req.rid, success=True, traces=self._end())

    def on_forward(self, step: int) -> None:
        """After each forward pass: start a pending profile at its step, stop one after num_steps."""
        if self.req is None:
            return
        if self.profiler is None:
            if self.req.start_step is not None and step >= self.req.start_step:
                self._begin()
            return
        self.steps_done += 1
        if self.req.num_steps is not None and self.steps_done >= self.req.num_steps:
            self._end()

    def _begin(self) -> None:
        assert self.req is not None
        req = self.req
        activities = [ProfilerActivity.CPU]
        if "GPU" in req.activities and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=req.record_shapes,
            with_stack=req.with_stack,
            profile_memory="MEM" in req.activities,
            experimental_config=_ExperimentalConfig(profile_all_threads=True),
        )
        self.profiler.start()
        self.steps_done = 0
        logger.info("profiling started (%s)", ", ".join(req.activities))
        if self.tell_followers is not None:
            self.tell_followers(ProfileReq(start=True, **_settings(req)))

    def _end(self) -> list[str]:
        """Stop and write the trace; a profile still waiting for its start_step is dropped."""
        assert self.req is not None
        req, profiler = self.req, self.profiler
        self.req = self.profiler = None
        if profiler is None:
            return []
        profiler.stop()
        path = os.path.join(req.output_dir, f"{req.profile_id}{self.suffix}.trace.json.gz")
        start = time.perf_counter()
        profiler.export_chrome_trace(path)
        logger.info("profiling stopped: %s (written in %.1f s)", path, time.perf_counter() - start)
        if self.tell_followers is not None:
            self.tell_followers(ProfileReq(start=False))
        return [path]


def _settings(req: ProfileReq) -> dict:
    """What a follower needs to start the same profile now."""
    return dict(
        output_dir=req.output_dir,
        profile_id=req.profile_id,
        activities=req.activities,
        with_stack=req.with_stack,
        record_shapes=req.record_shapes,
    )
