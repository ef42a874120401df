"""Runs the model worker on its own thread so the scheduler can prepare batch N+1 (and process
batch N-1's results) while batch N computes. On GPU the thread would own a CUDA stream; on CPU
the forward and the scheduler share the cores, so the overlap hides only the scheduler's Python
time that the forward's own threads leave idle."""

from __future__ import annotations

import contextlib
import queue
import threading
from concurrent.futures import Future

import torch

from srt.managers.tp_worker import BatchResult, TpModelWorker
from srt.model_executor.forward_batch_info import ForwardBatch


class OverlapTpModelWorker:
    """A TpModelWorker on its own thread: `launch` queues a batch and returns its result's Future."""

    def __init__(self, worker: TpModelWorker):
        self.worker = worker
        self.stream = torch.cuda.Stream() if worker.device == "cuda" else None
        self.input_queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="forward-worker", daemon=True)
        self.thread.start()

    def launch(self, fb: ForwardBatch, future_slots: list[int]) -> Future[BatchResult]:
        fut: Future[BatchResult] = Future()
        self.input_queue.put((fb, future_slots, fut))
        return fut

    def _loop(self) -> None:
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            while True:
                fb, slots, fut = self.input_queue.get()
                if self.stream is not None:
                    # the batch's host-to-device copies were queued on the scheduler's stream
                    self.stream.wait_stream(torch.cuda.default_stream())
                try:
                    fut.set_result(self.worker.run(fb, slots))
                except BaseException as e:  # re-raised in the scheduler thread by fut.result()
                    fut.set_exception(e)
