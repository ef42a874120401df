"""Control calls (server_info, flush_cache) through the real TokenizerManager and ZMQ sockets, with
the test playing two data-parallel replicas: a call that timed out because one replica was silent
must not wedge later calls, and that replica's late reply must not be taken as a later call's."""

import asyncio
import shutil

import pytest
import zmq
import zmq.asyncio

from srt.managers.io_struct import (
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
)
from srt.managers.scheduler_state import SchedulerState
from srt.managers.tokenizer_manager import TokenizerManager
from srt.server_args import PortArgs, ServerArgs
from srt.utils import zmq_socket

SCHEDULER_INFO = {"context_len": 2048, "max_total_num_tokens": 4096, "vocab_size": 49152, "max_running_requests": 8}
REPLY_WAIT_S = 10.0


def state(dp_rank: int, call: int) -> SchedulerState:
    """A replica's state, marked with the call it answers (as its forward count)."""
    return SchedulerState(
        dp_rank=dp_rank, num_running_reqs=0, num_queue_reqs=0, num_waiting_tokens=0, token_usage=0.0,
        cache_hit_rate=0.0, total_retractions=0, forward_passes=call, kv_available=0, kv_evictable=0,
        kv_protected=0, kv_capacity=0, req_slots_free=0, integrity_ok=True, forward_busy_s=0.0,
        forward_wait_s=0.0, forward_idle_fraction=0.0, overlap_schedule=False, attention_backend="cpu",
        torch_compile=None, cuda_graph=None, metrics=None, idle=True, pid=0,
    )  # fmt: skip


async def scenario(model_path: str, port_args: PortArgs) -> None:
    tm = TokenizerManager(ServerArgs(model_path=model_path, dp_size=2), port_args, SCHEDULER_INFO)
    tm.start()
    ctx = zmq.asyncio.Context()
    # what the replicas receive (the DP controller's input), and where their replies go
    control_in = zmq_socket(ctx, zmq.PULL, port_args.scheduler_input, bind=True)
    replies_out = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_input, bind=False)

    async def next_request():
        return await asyncio.wait_for(control_in.recv_pyobj(), REPLY_WAIT_S)

    try:
        # call 1: replica 1 stays silent, so the call times out
        call1 = asyncio.create_task(tm.get_internal_states(timeout=0.3))
        req1 = await next_request()
        assert isinstance(req1, GetInternalStateReq)
        await replies_out.send_pyobj(GetInternalStateReqOutput(rid=req1.rid, state=state(0, 1)))
        with pytest.raises(asyncio.TimeoutError):
            await call1
        assert tm.control_waiters == {}

        # call 2: replica 0 answers, then replica 1's late answer to call 1 arrives, then its answer to call 2
        call2 = asyncio.create_task(tm.get_internal_states(timeout=REPLY_WAIT_S))
        req2 = await next_request()
        assert req2.rid != req1.rid
        await replies_out.send_pyobj(GetInternalStateReqOutput(rid=req2.rid, state=state(0, 2)))
        await replies_out.send_pyobj(GetInternalStateReqOutput(rid=req1.rid, state=state(1, 1)))
        await replies_out.send_pyobj(GetInternalStateReqOutput(rid=req2.rid, state=state(1, 2)))
        assert await call2 == [state(0, 2), state(1, 2)]

        # call 3, another kind of control call: both replicas answer, one of them refuses
        call3 = asyncio.create_task(tm.flush_cache(timeout=REPLY_WAIT_S))
        req3 = await next_request()
        assert isinstance(req3, FlushCacheReq)
        await replies_out.send_pyobj(FlushCacheReqOutput(rid=req3.rid, success=False, message="busy"))
        await replies_out.send_pyobj(FlushCacheReqOutput(rid=req3.rid, success=True))
        out = await call3
        assert (out.success, out.message) == (False, "busy")
        assert tm.control_waiters == {}
    finally:
        assert tm.handle_loop_task is not None
        tm.handle_loop_task.cancel()
        await asyncio.gather(tm.handle_loop_task, return_exceptions=True)
        tm.close()
        control_in.close()
        replies_out.close()
        ctx.term()


def test_a_timed_out_control_call_does_not_wedge_later_ones(default_model_path):
    port_args = PortArgs.init_new()
    try:
        asyncio.run(scenario(default_model_path, port_args))
    finally:
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)
