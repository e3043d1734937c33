"""Evaluation built into the package: language models (loss, perplexity, bits per character over a whole split)
and image generators (Fréchet distance in a CIFAR-10 classifier's features, class balance, label accuracy)."""
