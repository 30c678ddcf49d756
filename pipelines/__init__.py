"""DVC stage scripts. Importing the package pins the CPU math paths before torch loads (see pipelines/cpu.py)."""

from pipelines.cpu import pin

pin()
