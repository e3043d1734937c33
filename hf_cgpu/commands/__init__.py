"""Subcommands of ``hf-cgpu`` that sit above the tasks: they read the tasks' settings and presets."""
