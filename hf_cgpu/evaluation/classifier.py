"""A CIFAR-10 classifier whose features score generated images: a ResNet-9-style net (BatchNorm, GELU, max pools).

Shape (widths c0..c3 = 64, 128, 256, 512 -> 6.57M parameters), 32x32 input in [-1, 1]:
    prep   conv_bn(3, c0)                                   @32
    layer1 conv_bn(c0, c1) + maxpool + residual(2 x conv_bn) @16
    layer2 conv_bn(c1, c2) + maxpool                         @8
    layer3 conv_bn(c2, c3) + maxpool + residual(2 x conv_bn) @4
    global max pool -> features (B, c3) -> linear (no bias) * logit_scale -> logits
``features`` (the penultimate layer) is what the Fréchet distance and precision/recall compare.

Saved as ``classifier.safetensors`` + ``classifier_config.json`` in one folder (no pickle); ``file_hash`` keys
caches of real-image features to these exact weights.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from ..errors import MissingPathError

WEIGHTS_NAME = "classifier.safetensors"
CONFIG_NAME = "classifier_config.json"


@dataclass
class ClassifierConfig:
    """Shape of the classifier; stored as classifier_config.json."""

    num_classes: int = 10
    widths: list[int] = field(default_factory=lambda: [64, 128, 256, 512])
    logit_scale: float = 0.125  # ResNet-9 (Page) scales its logits down; with label smoothing it trains faster
    image_size: int = 32
    class_names: list[str] | None = None

    def __post_init__(self) -> None:
        self.widths = [int(w) for w in self.widths]
        if len(self.widths) != 4 or min(self.widths) < 1:
            raise ValueError(f"widths={self.widths}; give four positive channel counts, e.g. 64,128,256,512")
        if self.image_size % 8:
            raise ValueError(f"image_size={self.image_size} must be divisible by 8 (three 2x max pools)")


def conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.GELU())


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(conv_bn(channels, channels), conv_bn(channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class CifarResNet(nn.Module):
    """ResNet-9-style classifier; input (B, 3, S, S) float in [-1, 1] (see ``to_classifier_input``)."""

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        self.config = config
        c0, c1, c2, c3 = config.widths
        self.prep = conv_bn(3, c0)
        self.layer1 = nn.Sequential(conv_bn(c0, c1), nn.MaxPool2d(2), Residual(c1))
        self.layer2 = nn.Sequential(conv_bn(c1, c2), nn.MaxPool2d(2))
        self.layer3 = nn.Sequential(conv_bn(c2, c3), nn.MaxPool2d(2), Residual(c3))
        self.head = nn.Linear(c3, config.num_classes, bias=False)

    @property
    def feature_dim(self) -> int:
        return self.config.widths[-1]

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) in [-1, 1] -> (B, c3) penultimate features (global max pool of the last block)."""
        h = self.layer3(self.layer2(self.layer1(self.prep(x))))  # (B, c3, S/8, S/8)
        return torch.amax(h, dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x)) * self.config.logit_scale  # (B, num_classes)


# ----------------------------------------------------------------------------- input convention
def to_classifier_input(images: torch.Tensor, value_range: tuple[float, float] = (-1.0, 1.0)) -> torch.Tensor:
    """Images -> what the classifier eats: (B, 3, H, W) float32 in [-1, 1], channels_last.

    uint8 input is read as 0..255 (decoded data, quantised samples). Float input is read as ``value_range``:
    (-1, 1) for the flow model's own space (``augment_on_device`` output, the sampler before clamping), (0, 1) for
    ``FlowMatchPipeline(output_type="pt")``. Float values outside ``value_range`` (beyond rounding) raise: a
    [0, 255] float batch passed as [-1, 1] would otherwise give silently wrong features.
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images of shape {tuple(images.shape)}; pass (B, 3, H, W)")
    if images.dtype == torch.uint8:
        x = images.float() / 127.5 - 1.0
    else:
        lo, hi = value_range
        x = images.float()
        if x.numel() and (x.min() < lo - 1e-3 or x.max() > hi + 1e-3):
            raise ValueError(f"float images span [{x.min():.3g}, {x.max():.3g}] outside value_range={value_range}; "
                             "pass uint8, or the range the images are in")
        x = (x - lo) * (2.0 / (hi - lo)) - 1.0
    return x.contiguous(memory_format=torch.channels_last)


# ----------------------------------------------------------------------------- save / load
def save_classifier(model: CifarResNet, folder: str | Path) -> None:
    """classifier.safetensors (weights and BatchNorm statistics) + classifier_config.json."""
    from safetensors.torch import save_model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = getattr(model, "_orig_mod", model)
    save_model(model, str(folder / WEIGHTS_NAME))
    (folder / CONFIG_NAME).write_text(json.dumps(asdict(model.config), indent=1) + "\n")


def load_classifier(folder: str | Path, device: torch.device | str = "cpu") -> CifarResNet:
    """The classifier saved in ``folder``, in eval mode on ``device``; a one-line FileNotFoundError if absent."""
    from safetensors.torch import load_model

    folder = Path(folder)
    if not (folder / WEIGHTS_NAME).is_file() or not (folder / CONFIG_NAME).is_file():
        raise MissingPathError(f"no {WEIGHTS_NAME} + {CONFIG_NAME} in {folder}; train one with "
                                f"`python recipes/train_classifier.py --preset cifar10 --output_dir {folder}`")
    config = ClassifierConfig(**json.loads((folder / CONFIG_NAME).read_text()))
    model = CifarResNet(config)
    load_model(model, str(folder / WEIGHTS_NAME), strict=True)
    return model.to(device=device, memory_format=torch.channels_last).eval()


def file_hash(folder: str | Path) -> str:
    """sha256 (16 hex digits) of the weights and config files: changes whenever the classifier does."""
    h = hashlib.sha256()
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        h.update((Path(folder) / name).read_bytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def classify(model: CifarResNet, images: torch.Tensor, batch_size: int = 500,
             value_range: tuple[float, float] = (-1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """(features (N, D) float32, logits (N, K) float32) on the CPU, batch by batch on the model's device, fp32."""
    device = next(model.parameters()).device
    feats, logits = [], []
    for start in range(0, len(images), batch_size):
        x = to_classifier_input(images[start : start + batch_size].to(device), value_range)
        f = model.features(x).float()
        feats.append(f.cpu())
        logits.append((model.head(f) * model.config.logit_scale).float().cpu())
    dim = model.feature_dim
    return (torch.cat(feats) if feats else torch.zeros(0, dim),
            torch.cat(logits) if logits else torch.zeros(0, model.config.num_classes))

