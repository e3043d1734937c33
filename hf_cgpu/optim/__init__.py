"""Optimizers beyond AdamW: Muon for the hidden weight matrices with AdamW for the rest (``muon``)."""

from .muon import MuonWithAdamW, muon_param_groups

__all__ = ["MuonWithAdamW", "muon_param_groups"]
