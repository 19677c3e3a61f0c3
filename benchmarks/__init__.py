"""`specdec bench`: measured speedups, side by side with Hugging Face in one run.

Sits above every layer (it drives the core, the Ray actors and, later, the HTTP service) and plugs
its command into the core CLI through the `specdec.cli` entry point group.
"""
