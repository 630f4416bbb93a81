"""Real models for the torch executor backend: presets, tokenizers, pipeline stages.

Everything here imports torch; nothing in `lemix.planner`, `lemix.sim` or
`lemix.engine` may import it.
"""
