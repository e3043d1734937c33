"""Data loading for the recipes: ``text`` (corpora, tokenizer, packed token blocks) and ``images``.

Submodules are imported explicitly (``from hf_cgpu.data.text import pack_dataset``) so that importing one
modality does not pull in the other's dependencies.
"""
