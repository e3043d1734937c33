"""Tasks plug a model family into the one loop (``hf_cgpu.train.fit``): causal LM pretraining, fine-tuning, flow
matching on images, the 2D flow toy, the CIFAR classifier. Each supplies batches and a loss and declares what it
needs in the ``TaskPlan`` its ``setup`` returns."""
