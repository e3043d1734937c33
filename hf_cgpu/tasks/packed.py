"""What every language-model task shares: training windows cut from a packed token stream
(``hf_cgpu.data.packing.PackedTokens`` + ``data.windows.WindowOrder``), token counting, and validation over the whole validation
split: mean loss per token, perplexity and bits per character (comparable across tokenizers)."""

from __future__ import annotations


import torch

from ..data.windows import WindowOrder
from ..evaluation.text import score_stream
from ..train import Task


class PackedTokensTask(Task):
    """Subclasses set ``self.train_data`` / ``self.val_data`` in ``setup`` and define ``target_loss``.

    ``data_order`` (``shifted`` | ``random`` | ``fixed``, see ``WindowOrder``) says how training windows are cut.
    """

    unit = "tok"
    best_metric = "val_loss"
    data_order = "shifted"

    def sample_order(self, seed: int):
        return WindowOrder(self.train_data.n_tokens, self.train_data.seq_len + 1, seed, self.data_order)

    def train_batch(self, indices, device, generator) -> dict:
        window = self.train_data.seq_len + 1
        return {"input_ids": self.train_data.windows(indices.numpy(), window).to(device, non_blocking=True)}

    def units(self, batch) -> int:
        return batch["input_ids"][:, :-1].numel()

    def target_loss(self, model, inputs: torch.Tensor, targets: torch.Tensor, **kwargs) -> torch.Tensor:
        """Mean cross-entropy of ``model(inputs, **kwargs)`` against already shifted ``targets`` (-100 = not scored);
        ``kwargs`` may hold ``position_ids`` (packed rows)."""
        raise NotImplementedError

    def loss(self, model, batch, generator) -> torch.Tensor:
        block = batch["input_ids"]  # (B, S + 1): position t predicts token t + 1
        targets = batch.get("targets", block)  # -100 where nothing is scored (prompts, padding)
        extra = {"position_ids": batch["position_ids"][:, :-1]} if "position_ids" in batch else {}
        return self.target_loss(model, block[:, :-1], targets[:, 1:], **extra)

    def eval_micro_batches(self, settings) -> float:
        val = getattr(self, "val_data", None)  # a fine-tuning run may hold out nothing
        if val is None:
            return 0.0
        windows = len(val)
        return min(windows, settings.eval_batches * settings.micro_batch_size or windows) / settings.micro_batch_size

    def evaluate(self, model, settings, device) -> dict[str, float]:
        limit = settings.eval_batches * settings.micro_batch_size if settings.eval_batches > 0 else None
        return score_stream(
            lambda x, y: self.target_loss(model, x, y), self.val_data, self.val_data.seq_len,
            settings.micro_batch_size, device, max_windows=limit, prefix="val_",
        )
