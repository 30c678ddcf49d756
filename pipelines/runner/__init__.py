"""Run everything with every core: `dvc repro`, with the stale grid cells run concurrently.

    python -m pipelines.run                      # local process pool: one worker per core (per GPU with CUDA)
    python -m pipelines.run --workers 1          # one cell at a time (CPU)
    python -m pipelines.run --gpus 0,1 --workers-per-gpu 2   # 4 workers, 2 on each of GPUs 0 and 1
    python -m pipelines.run --ray-address auto   # cells as Ray tasks (pip install -e '.[ray]'), shared filesystem
    python -m pipelines.run --gpus 0 --population 256   # up to 256 cells of one structure per worker, batched
                                                        # (pipelines/runner/population.py; the CPU default stays 1 cell)

Placement. Without CUDA (torch sees no device; `CUDA_VISIBLE_DEVICES=` hides them) workers are CPU processes, one
per core or --workers. With CUDA each worker owns one GPU for its life: its CUDA_VISIBLE_DEVICES is set to that
GPU's entry before CUDA starts in it, so its cells run on `cuda` (= that GPU). Default: one worker per visible
GPU; --gpus picks GPUs (entries of the runner's CUDA_VISIBLE_DEVICES if set, else device indices);
--workers-per-gpu N puts N workers (N cells at once) on each; --workers N instead spreads N workers evenly. On
Ray every cell asks for RLHF_THREADS CPUs and, when the cluster has GPUs, 1/N of a GPU (N = --workers-per-gpu,
default 1); Ray sets CUDA_VISIBLE_DEVICES. One cell is one DVC stage either way. Flags that contradict the
machine or each other are refused in one line before anything runs.

Steps: 1. validate params.yaml and check that the `python` of dvc.yaml's commands, resolved as DVC will resolve it,
is this interpreter (nothing runs if either is wrong); 2. take the repository's runner lock (one runner at a time),
restore dvc.lock from its last good copy if a killed DVC left it broken, remove the temporary files of killed
stages, mark MLflow runs left RUNNING by a killed run FAILED; 3. ask `dvc status` which upstream stages (data ->
sft -> rm, one chain per task instance) are stale and build the chains in parallel on the same workers: a chain
whose first stale stage is k runs stages k..end in order (each by its dvc.yaml command's module function in the
worker, as a cell), finished stages recorded in dvc.lock as in step 4, all of them before any cell starts; a
failed stage stops the run; 4. ask `dvc status` which calibration cells are stale and run them as in step 5, then
`dvc repro <task>_calibrate` (the protocol is fixed before any evaluation cell runs); 5. ask `dvc status` which
evaluation cells are stale and run them in parallel, each with
torch threads set to RLHF_THREADS (default 1), printing one line per finished cell, and record finished cells in
dvc.lock while the others run (a batch at most every --commit-every seconds), exactly as `dvc repro` would have;
6. `dvc repro` for the rest (the analysis).

Stopping: Ctrl-C or SIGTERM (what `timeout`, `kill` and job schedulers send) stops the workers at once (their
MLflow runs are marked FAILED), records the cells (or upstream stages) that finished, and exits with one line
(status 130 or 143).
A recording in progress always completes: it runs in its own process session, so a terminal's Ctrl-C does not
reach it, and the runner waits for it; pressing Ctrl-C again changes nothing. Workers, and DVC with the stage it
runs (the analysis), die with the runner even when it is killed with SIGKILL; the cells recorded by then are kept,
the next run redoes the others (and marks the MLflow runs the killed processes left RUNNING as FAILED).
Each cell is recorded only with the params.yaml values it ran with (lockfile.commit compares them): a cell whose
parameters changed while it ran, or before it was recorded, is left stale and named, and the run fails at the end.
DVC writes dvc.lock through pipelines.runner.lockfile, which only ever replaces it whole.

Modules: ``cli`` (the command line and the waves), ``plan`` (what is stale, where workers go), ``worker`` (what runs
in a worker process), ``local`` and ``ray`` (the two kinds of workers), ``record`` (finished cells into dvc.lock),
``repo`` (the runner lock, repairs at start), ``dvccli`` (DVC's command line), ``lockfile`` (every use of DVC's
internals), ``mlflow_runs`` (every MLflow call of the runner), ``signals`` (errors and Ctrl-C/SIGTERM).
"""
