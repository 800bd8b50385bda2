"""Textual widgets of the workbench (token diff view, throughput graph, model bar, run strip)."""
