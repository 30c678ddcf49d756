"""Cells as Ray tasks on a cluster that shares the repository's filesystem (pip install -e '.[ray]')."""

from __future__ import annotations

import os
from contextlib import suppress

from pipelines import tracking
from pipelines.cpu import THREADS_ENV
from pipelines.runner.signals import RunnerError
from pipelines.runner.worker import cell_in_worker


def ray_resources(cluster_gpus: float, workers_per_gpu: int | None, threads: int) -> dict:
    """What one cell asks Ray for: ``threads`` CPUs (its torch threads) and, on a cluster with GPUs, 1/N of a GPU
    (N cells per GPU at once, N = ``workers_per_gpu``, default 1). Ray then sets the task's CUDA_VISIBLE_DEVICES."""
    if workers_per_gpu is not None and not cluster_gpus:
        raise RunnerError(f"--workers-per-gpu {workers_per_gpu}: the Ray cluster has no GPUs", 2)
    return {"num_cpus": threads, "num_gpus": 1 / (workers_per_gpu or 1) if cluster_gpus else 0}


class RayPool:
    """Cells as Ray tasks (``ray_resources`` each) on a cluster that shares the repository's filesystem."""

    def __init__(self, address: str, workers_per_gpu: int | None = None):
        import ray

        self.ray = ray
        keys = (THREADS_ENV, "TQDM_DISABLE", "MLFLOW_TRACKING_URI", tracking.PARENT_ENV)
        env = {k: os.environ[k] for k in keys if k in os.environ}
        ray.init(address=address, runtime_env={"env_vars": env})
        try:
            res = ray_resources(ray.cluster_resources().get("GPU", 0), workers_per_gpu, int(env[THREADS_ENV]))
        except RunnerError:
            ray.shutdown()
            raise
        print(f"Ray: each cell asks for {res['num_cpus']} CPU and {res['num_gpus']:g} GPU", flush=True)
        self.remote = ray.remote(**res)(cell_in_worker)

    def submit(self, *args):
        return self.remote.remote(*args)

    def wait(self, pending: set, timeout: float) -> set:
        return set(self.ray.wait(list(pending), num_returns=1, timeout=timeout)[0])

    def result(self, handle) -> dict:
        return self.ray.get(handle)

    def close(self) -> None:
        self.ray.shutdown()

    def stop(self, pending) -> None:
        for ref in pending:
            with suppress(Exception):
                self.ray.cancel(ref, force=True)
        self.ray.shutdown()
