"""Tasks plug a model family into the one loop (``hf_cgpu.loop.fit``): causal LM, fine-tune, flow images."""
