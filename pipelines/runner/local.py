"""Local workers: a process pool (spawned, one per core by default; on GPUs one per CUDA_VISIBLE_DEVICES slot)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import resource_tracker

from pipelines.runner.worker import cell_in_worker, init_worker

GRACE_S = 10.0  # a stopped worker's time to mark its MLflow run FAILED before it is killed


class LocalPool:
    """Cells in a process pool (spawned workers, one per core by default; on GPUs one per entry of ``slots``)."""

    def __init__(self, workers: int, slots: list[str] | None = None):
        """``slots``: the CUDA_VISIBLE_DEVICES of each worker (``workers`` entries), or None for CPU workers."""
        resource_tracker.ensure_running()  # before submit blocks Ctrl-C: starting it unblocks SIGINT (CPython 3.11)
        ctx = multiprocessing.get_context("spawn")
        gpus = None
        if slots is not None:
            gpus = ctx.SimpleQueue()  # put() writes to the pipe at once: every slot is there before a worker starts
            for gpu in slots:
                gpus.put(gpu)
        self.pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=init_worker, initargs=(os.getpid(), gpus))
        self.stopped = False

    def submit(self, *args):
        """Queues a cell; a worker spawned here starts with Ctrl-C blocked (the signal mask survives exec), so a
        Ctrl-C while it imports cannot kill it with a traceback; init_worker ignores it, then unblocks it. The
        runner gets a Ctrl-C of these moments when the mask is restored (multiprocessing starts its resource
        tracker the same way)."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return self.pool.submit(cell_in_worker, *args)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def wait(self, pending: set, timeout: float) -> set:
        return wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)[0]

    def result(self, handle) -> dict:
        return handle.result()

    def close(self) -> None:
        """Ends the workers once every cell is done: idle, they exit at once on SIGTERM (init_worker), sparing the
        seconds that an interpreter which has loaded torch, matplotlib and MLflow takes to finalize (~17 s of the
        runner's end on the loaded 2-core machine, after an analysis ran in a worker)."""
        if not self.stopped:
            self.stop([])

    def stop(self, pending) -> None:
        """Cancels the queued cells and stops the running ones: SIGTERM, then SIGKILL after GRACE_S."""
        self.stopped = True
        procs = multiprocessing.active_children()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + GRACE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
