"""meshplan planner: model and plan specs, presets, and the plan search."""

__version__ = "0.1.0"
