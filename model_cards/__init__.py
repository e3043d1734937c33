"""Model card templates (Jinja2 + YAML front matter), one per model kind: gpt.md, flow.md, lora.md.

This folder is installed as the package ``hf_cgpu.model_cards`` (setup.py maps it), so ``hf_cgpu.hub`` reads the
templates with ``importlib.resources`` wherever hf_cgpu is installed; this file makes it a regular package, which
editable installs need to find it."""
