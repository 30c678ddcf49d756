"""One CPU code path for the float math of every stage, so that x86-64 machines with AVX2 compute the same bits.

Three libraries do a stage's float math on the CPU and each picks its code path from the CPU it runs on: ATen's
own kernels (LayerNorm, softmax, reductions, Adam) by "CPU capability" (AVX-512, AVX2 or default), MKL (every
matmul) by its dispatcher, oneDNN (GELU) by its JIT. The vector width changes the order of float sums, so an
AVX-512 machine and an AVX2 machine round differently, and PPO turns a last-bit difference into a different run
(issue 8, item 1). ``pin`` caps all three at AVX2, the newest instruction set every such machine has:

    ATEN_CPU_CAPABILITY=avx2    ATen's DispatchStub (aten/src/ATen/native/DispatchStub.cpp, compute_cpu_capability:
                                read once, at the first dispatched kernel; not checked against the CPU, so it is
                                set only where /proc/cpuinfo lists avx2 and fma)
    MKL_CBWR=AVX2               MKL's conditional numerical reproducibility (oneMKL developer guide, "Specifying
                                code branches"): the AVX2 code branch with fixed cache sizes and reductions. Not
                                STRICT (alignment-independent, ~10% more per matmul): torch's allocator aligns every
                                buffer to 64 bytes, so each operand's alignment is the same on every machine
    MKL_ENABLE_INSTRUCTIONS=AVX2  MKL's dispatcher itself capped at AVX2: with the dispatcher told the CPU is a
                                Skylake-SP (MKL_ENABLE_INSTRUCTIONS=AVX512), MKL 2024.2 keeps AVX-512 kernels for
                                edge-sized products (e.g. 15x16x15, 512x64x1) despite CNR's AVX2 branch
                                (benchmarks/cross_machine.py shows the different bits)
    ONEDNN_MAX_CPU_ISA=AVX2     oneDNN's JIT ISA limit (oneDNN docs, "CPU dispatcher control")

The libraries read them when they first run, so they must be in the environment before torch is imported:
``pipelines/__init__.py`` calls ``pin()``, and every stage (``python -m pipelines.<stage>``) and pool worker
imports ``pipelines.*`` before torch. ``check`` (run by ``common.setup``) fails a stage where the pin did not take
effect because torch came first, and warns where the CPU cannot follow it (no AVX2; or a non-Intel CPU, where
oneMKL documents that its AVX2 branch may fall back to the AUTO one). ``RLHF_CPU_PIN=off`` leaves the libraries
to choose (the speed benchmark and benchmarks/cross_machine.py use it); ``settings`` reports what is in effect.
Threads are fixed separately (``common.setup``, one by default): MKL's reproducibility also assumes a fixed count.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from pathlib import Path

PIN_ENV = "RLHF_CPU_PIN"  # "on" (the default) or "off"
THREADS_ENV = "RLHF_THREADS"  # torch threads of a stage (common.setup; the runner sets it for its workers)
PIN = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
EXPECTED = {"aten_cpu_capability": "AVX2", "mkl_cbwr": "AVX2"}  # what settings() reports when it held

# oneMKL mkl_service.h: MKL_CBWR_* branch values; MKL_CBWR_STRICT is a flag bit.
_MKL_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX"}
_MKL_BRANCHES |= {10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}
_MKL_STRICT = 0x10000


def pinned() -> bool:
    value = os.environ.get(PIN_ENV, "on")
    if value not in ("on", "off"):
        raise ValueError(f"{PIN_ENV} must be 'on' or 'off' (got {value!r})")
    return value == "on"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pin_env() -> dict[str, str]:
    """The variables ``pin`` sets on this machine: ``PIN``, less ATen's where the CPU lacks AVX2 or FMA."""
    has_avx2 = {"avx2", "fma"} <= _cpu_flags()
    return {k: v for k, v in PIN.items() if has_avx2 or k != "ATEN_CPU_CAPABILITY"}


def pin() -> None:
    """Puts ``pin_env()`` in the environment, unless RLHF_CPU_PIN=off or torch is already imported (then ``check``
    reports it: setting the variables after the libraries have read them would pin some and not others)."""
    if pinned() and "torch" not in sys.modules:
        os.environ.update(pin_env())


def _mkl_cbwr() -> str:
    """MKL's conditional-reproducibility mode in effect, e.g. 'OFF', 'AVX2', 'AVX2,STRICT'; 'unknown' without MKL."""
    import torch

    try:  # mkl_cbwr_get's implementation, exported by the MKL that the CPU wheel links statically
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        value = lib.mkl_serv_cbwr_get(-1)  # MKL_CBWR_ALL: branch and flags
    except (OSError, AttributeError):
        return "unknown"
    branch = _MKL_BRANCHES.get(value & 0xFFFF, str(value & 0xFFFF))
    return branch + (",STRICT" if value & _MKL_STRICT else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def settings() -> dict[str, str]:
    """What decides the float results of this process, as strings (for MLflow tags or a metrics file)."""
    import torch

    return {
        "cpu_pin": "on" if pinned() else "off",
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": _mkl_cbwr(),
        "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "unset"),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "unset"),
        "torch_threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "cpu_model": _cpu_model(),
    }


def check() -> dict[str, str]:
    """Returns ``settings()``. Raises if the pin is on but was never applied (torch imported before pipelines);
    warns if it was applied but this CPU cannot follow it (results then differ from other machines' bits)."""
    got = settings()
    if not pinned():
        return got
    if any(os.environ.get(k) != v for k, v in pin_env().items()):
        raise RuntimeError(
            "CPU math paths are not pinned: torch was imported before the pipelines package. Import pipelines "
            f"first (python -m pipelines.<stage> does), or set {PIN_ENV}=off to run unpinned."
        )
    off = {k: got[k] for k, v in EXPECTED.items() if got[k] != v and got[k] != "unknown"}
    if off:
        warnings.warn(
            f"this CPU did not take the pinned code path ({off}; wanted {EXPECTED}): results may differ in "
            "the last bits from other machines' (expected on AMD CPUs: README.md, section Reproducibility)",
            RuntimeWarning,
            stacklevel=2,
        )
    return got
