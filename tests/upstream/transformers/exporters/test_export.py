"""Stand-in, NOT upstream code: the transformers 5.25.0 sdist ships only ``tests/*.py``, without ``tests/exporters/``.

``test_modeling_common.ModelTesterMixin`` inherits ``ExportTesterMixin`` from here. hf_cgpu's own export checks (static
and dynamic shapes, outputs equal to eager) live in ``tests/test_gpt_hf_conventions.py``; this class adds none.
"""


class ExportTesterMixin:
    pass
