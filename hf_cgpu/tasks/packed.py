"""What every language-model task shares: packed ``seq_len + 1`` token blocks (``hf_cgpu.data.text.PackedTokens``)
turned into micro-batches, token counting, and validation loss / perplexity over the first validation blocks."""

from __future__ import annotations

import math

import torch

from ..loop import Task


class PackedTokensTask(Task):
    """Subclasses set ``self.train_data`` / ``self.val_data`` in ``setup`` and define ``loss``."""

    unit = "tok"

    @staticmethod
    def blocks(data, indices: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(data.blocks[indices.numpy()].astype("int64"))  # (B, S + 1)

    def num_train_samples(self) -> int:
        return len(self.train_data)

    def train_batch(self, indices, device, generator) -> dict:
        return {"input_ids": self.blocks(self.train_data, indices).to(device, non_blocking=True)}

    def units(self, batch) -> int:
        return batch["input_ids"][:, :-1].numel()

    def evaluate(self, model, settings, device) -> dict[str, float]:
        n = min(len(self.val_data), settings.eval_batches * settings.micro_batch_size)
        losses = [
            self.loss(model, {"input_ids": self.blocks(self.val_data, torch.arange(s, min(n, s + settings.micro_batch_size))).to(device)}, None).float()
            for s in range(0, n, settings.micro_batch_size)
        ]
        if not losses:
            return {}
        val = torch.stack(losses).mean().item()
        return {"val_loss": val, "val_perplexity": math.exp(min(val, 50.0))}
