"""Data for the tasks, a module per job: ``corpus`` (text corpora), ``tokenizer`` (the byte-level BPE), ``packing`` (the
memory-mapped token stream), ``windows`` (which tokens a step trains on), ``instruct`` (instruction rows), ``images``
(image splits decoded once), ``files`` (checks of data files).

Submodules are imported explicitly (``from hf_cgpu.data.packing import pack_dataset``) so that importing one does not
pull in the others' dependencies.
"""
