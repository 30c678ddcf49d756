"""Experiment design and statistics: the params.yaml schema, the grid of cells, the analysis protocol and the report."""
