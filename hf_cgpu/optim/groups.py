"""Parameter groups every optimizer builder shares: the input embedding tables at their own learning rate.

Embedding rows are updated only where their tokens occur, so each row sees few steps; a learning rate well above the
matrices' speeds them up (modded-nanogpt trains its embeddings with Adam at several hundred times its matrices' rate).
The group keeps the per-step weight decay it had: its ``weight_decay`` is scaled by ``learning_rate /
embedding_learning_rate``, so decoupled decay (lr x wd per step) shrinks the tables as much as before.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import SettingsError


def output_weight_ids(model: nn.Module) -> set[int]:
    """The id of the output head's weight (tied or not), or nothing where the model has no head."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {id(head.weight)} if head is not None and getattr(head, "weight", None) is not None else set()


def embedding_table_ids(model: nn.Module) -> set[int]:
    """Weights of the ``nn.Embedding`` modules that are not also the output head (a tied token table is the head)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return tables - output_weight_ids(model)


def with_embedding_lr(model: nn.Module, groups: list[dict[str, Any]], settings: Any) -> list[dict[str, Any]]:
    """``groups`` with the embedding tables moved into a group of their own at ``--embedding_learning_rate``
    (``lr_scale`` over ``--learning_rate``, as the schedule reads it); unchanged when that setting is 0."""
    embed_lr = getattr(settings, "embedding_learning_rate", 0.0)
    if not embed_lr:
        return groups
    tables = embedding_table_ids(model)
    moved = [p for g in groups if not g.get("use_muon") for p in g["params"] if id(p) in tables]
    if not moved:
        raise SettingsError("--embedding_learning_rate has no table to act on: the model's only embedding is the "
                            "token table tied to its head; add --tie_word_embeddings false or drop the flag")
    ids = {id(p) for p in moved}
    kept = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in groups]
    scale = embed_lr / settings.learning_rate
    embed = {"params": moved, "lr": embed_lr, "lr_scale": scale, "weight_decay": settings.weight_decay / scale}
    if any("use_muon" in g for g in groups):
        embed["use_muon"] = False
    return [g for g in kept if g["params"]] + [embed]


__all__ = ["embedding_table_ids", "output_weight_ids", "with_embedding_lr"]
