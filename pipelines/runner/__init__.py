"""Run everything with every core: `dvc repro`, with the stale grid cells run concurrently.

    python -m pipelines.run                      # local process pool: one worker per core (per GPU with CUDA)
    python -m pipelines.run --workers 1          # one cell at a time (CPU)
    python -m pipelines.run --gpus 0,1 --workers-per-gpu 2   # 4 workers, 2 on each of GPUs 0 and 1
    python -m pipelines.run --ray-address auto   # cells as Ray tasks on the cluster this machine belongs to (the
                                                 # `ray` extra); no other node needs the repository
    python -m pipelines.run --gpus 0 --population 256   # up to 256 cells of one structure per worker, batched
                                                        # (pipelines/runner/population.py; the CPU default stays 1 cell)

Placement. Without CUDA (torch sees no device; `CUDA_VISIBLE_DEVICES=` hides them) workers are CPU processes, one
per core or --workers. With CUDA each worker owns one GPU for its life: its CUDA_VISIBLE_DEVICES is set to that
GPU's entry before CUDA starts in it, so its cells run on `cuda` (= that GPU). Default: one worker per visible
GPU; --gpus picks GPUs (entries of the runner's CUDA_VISIBLE_DEVICES if set, else device indices);
--workers-per-gpu N puts N workers (N cells at once) on each; --workers N instead spreads N workers evenly. On
Ray every cell asks for RLHF_THREADS CPUs and, when the cluster has GPUs, 1/N of a GPU (N = --workers-per-gpu,
default 1); Ray sets CUDA_VISIBLE_DEVICES. On Ray a cell runs by value (pipelines/runner/ray.py): it is shipped
its inputs and returns its files and MLflow runs, which the runner writes here. One cell is one DVC stage either
way. Flags that contradict the machine or each other are refused in one line before anything runs.

Steps: 1. validate params.yaml and check that the `python` of dvc.yaml's commands, resolved as DVC will resolve it,
is this interpreter (nothing runs if either is wrong); 2. take the repository's runner lock (one runner at a time),
restore dvc.lock from its last good copy if a killed DVC left it broken, remove the temporary files of killed
stages, mark MLflow runs left RUNNING by a killed run FAILED; 3. ask `dvc status` which upstream stages (data ->
sft -> rm, one chain per task instance) are stale and build the chains in parallel on the same workers: a chain
whose first stale stage is k runs stages k..end in order (each by its dvc.yaml command's module function in the
worker, as a cell), finished stages recorded in dvc.lock as in step 4, all of them before any cell starts; a
failed stage stops the run; 4. ask `dvc status` which calibration cells are stale and run them as in step 5, and
each task's `<task>_calibrate` in a worker as soon as that task's calibration cells have finished (the protocol is
fixed before any evaluation cell runs); 5. ask `dvc status` which evaluation cells are stale and run them in
parallel, each with torch threads set to RLHF_THREADS (default 1), printing one line per finished cell, and record
finished cells in dvc.lock while the others run (a batch at most every --commit-every seconds), exactly as `dvc
repro` would have; each task's `<task>_analysis` runs in a worker as soon as that task's cells have finished (both
tasks' at once when they finish together) and is recorded the same way. A calibrate or analysis stage runs when
`dvc status` calls it stale or a cell of its task ran in the wave; it runs as `dvc repro` runs it (outputs removed,
then its dvc.yaml command; pipelines.runner.worker ``tail_stage``), on Ray in local workers (it reads git history).
Steps 3-5 reuse one `dvc status` answer until a stage has run (only a stage that runs changes it): a run with nothing
upstream, calibration or planning to do asks once.

Stopping: Ctrl-C or SIGTERM (what `timeout`, `kill` and job schedulers send) stops the workers at once (their
MLflow runs are marked FAILED; on Ray every task is cancelled, its worker killed), records the cells (or upstream
stages) that finished, and exits with one line (status 130 or 143).
A recording in progress always completes: it runs in its own process session, so a terminal's Ctrl-C does not
reach it, and the runner waits for it; pressing Ctrl-C again changes nothing. Local workers (and the calibrate or
analysis stage they run) and DVC die with the runner even when it is killed with SIGKILL (Ray ends the tasks of a
driver that is gone); the cells recorded by then are kept,
the next run redoes the others (and marks the MLflow runs the killed processes left RUNNING as FAILED).
Each cell is recorded only with the params.yaml values it ran with (lockfile.commit compares them): a cell whose
parameters changed while it ran, or before it was recorded, is left stale and named, and the run fails at the end.
DVC writes dvc.lock through pipelines.runner.lockfile, which only ever replaces it whole.

Modules: ``cli`` (the command line and the waves), ``plan`` (what is stale, where workers go), ``worker`` (what runs
in a worker process), ``local`` and ``ray`` (the two kinds of workers; ``remote``: what runs on a Ray node),
``record`` (finished cells into dvc.lock),
``repo`` (the runner lock, repairs at start), ``dvccli`` (DVC's command line), ``lockfile`` (every use of DVC's
internals), ``mlflow_runs`` (every MLflow call of the runner), ``signals`` (errors and Ctrl-C/SIGTERM).
"""
