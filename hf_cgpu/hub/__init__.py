"""The Hub side of a run, a module per job: ``checks`` (Hub ids given on the command line), ``cards`` (the card
registry and rendering), ``push`` (uploading a finished folder, ``hf-cgpu push``)."""

from .cards import CARDS, CardSpec, count_parameters, detect_kind, public_value, render_model_card, template_dir
from .checks import HubError, check_dataset, check_hub_model
from .push import UPLOAD_IGNORE_PATTERNS, HubPusher, push_to_hub, upload_file_list

__all__ = ["CARDS", "CardSpec", "HubError", "HubPusher", "UPLOAD_IGNORE_PATTERNS", "check_dataset", "check_hub_model",
           "count_parameters", "detect_kind", "public_value", "push_to_hub", "render_model_card", "template_dir",
           "upload_file_list"]
