"""Stand-in, NOT upstream code: the transformers 5.25.0 sdist ships only ``tests/*.py``, without ``tests/generation/``.

``test_modeling_common`` imports ``GenerationTesterMixin`` from here (``test_generation_tester_mixin_inheritance``
checks that a generative model's tester inherits it). hf_cgpu's equivalents of the upstream generation checks are
the methods of this class, written for this repository (see tests/upstream/README.md for the list).
"""

from gpt_generation_checks import GenerationChecks as GenerationTesterMixin  # noqa: F401
