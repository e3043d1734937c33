"""Everything declarative is in setup.cfg; this file only adds what setup.cfg cannot say next to ``packages = find:``.

The model card templates stay in the top-level ``model_cards/`` folder (reviewed like the docs, one copy) and
install as the package ``hf_cgpu.model_cards`` through a ``package_dir`` mapping, so ``hf_cgpu.hub`` reads them with
``importlib.resources`` from a wheel, an sdist install or an editable checkout alike. No copy, no symlink.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["hf_cgpu", "hf_cgpu.*"]), "hf_cgpu.model_cards"],
    package_dir={"hf_cgpu.model_cards": "model_cards"},
    package_data={"hf_cgpu": ["presets/*/*.json"], "hf_cgpu.model_cards": ["*.md"]},
)
