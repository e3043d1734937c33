"""Image-generator metrics in a classifier's feature space: Fréchet distance, improved precision/recall, class balance.

Inputs are feature matrices (N, D) from ``image_features`` (the classifier's penultimate layer) and label vectors.
Image input convention (``image_features``): uint8 = 0..255; float = ``value_range``, by default [-1, 1] (the flow
model's space), (0, 1) for ``FlowMatchPipeline(output_type="pt")``.

- ``frechet_distance``: ||mu1 - mu2||^2 + tr(S1 + S2 - 2 (S1^1/2 S2 S1^1/2)^1/2) in float64. The trace of the matrix
  square root is taken from the eigenvalues of the symmetric PSD product S1^1/2 S2 S1^1/2 (``torch.linalg.eigh``,
  negative round-off clamped), which equal those of S1 S2: no scipy, no complex parts to discard.
- ``precision_recall``: Kynkäänniemi et al. 2019. Each real feature gets a ball reaching its k-th nearest real
  neighbour; precision = share of generated features inside some real ball, recall = the same with roles swapped.
- ``class_statistics``: histogram of predicted classes, their largest/smallest share against uniform, and the
  accuracy of predicted vs requested labels (how often the generator draws the class it was asked for).
- ``inception_fid``: the standard Inception-v3 FID through torchmetrics, only when it is installed and a local
  weights file is given; otherwise None and a note (never a download).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from .classifier import classify


def image_features(classifier, images: torch.Tensor, batch_size: int = 500,
                   value_range: tuple[float, float] = (-1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """(features (N, D), logits (N, K)) float32 on the CPU; see ``to_classifier_input`` for the input range."""
    return classify(classifier, images, batch_size=batch_size, value_range=value_range)


def feature_statistics(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean (D,), covariance (D, D)) in float64, covariance with the unbiased 1 / (N - 1)."""
    f = features.double()
    if f.shape[0] < 2:
        raise ValueError(f"need at least 2 feature vectors for a covariance, got {f.shape[0]}")
    mu = f.mean(0)
    centred = f - mu
    return mu, centred.T @ centred / (f.shape[0] - 1)


def _sqrt_psd(matrix: torch.Tensor) -> torch.Tensor:
    """Symmetric square root of a symmetric PSD matrix by eigendecomposition (negative round-off clamped to 0)."""
    vals, vecs = torch.linalg.eigh(matrix)
    return (vecs * vals.clamp(min=0).sqrt()) @ vecs.T


def frechet_distance(mu1: torch.Tensor, sigma1: torch.Tensor, mu2: torch.Tensor, sigma2: torch.Tensor) -> float:
    """Fréchet distance between the Gaussians N(mu1, sigma1) and N(mu2, sigma2), computed in float64."""
    mu1, mu2, sigma1, sigma2 = (t.double() for t in (mu1, mu2, sigma1, sigma2))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError(f"feature sizes differ: {tuple(mu1.shape)} vs {tuple(mu2.shape)}; use the same classifier")
    sigma1, sigma2 = (sigma1 + sigma1.T) / 2, (sigma2 + sigma2.T) / 2
    root1 = _sqrt_psd(sigma1)
    product = root1 @ sigma2 @ root1
    trace_sqrt = torch.linalg.eigvalsh((product + product.T) / 2).clamp(min=0).sqrt().sum()
    diff = mu1 - mu2
    return float(diff @ diff + torch.trace(sigma1) + torch.trace(sigma2) - 2 * trace_sqrt)


def frechet_distance_of_features(a: torch.Tensor, b: torch.Tensor) -> float:
    return frechet_distance(*feature_statistics(a), *feature_statistics(b))


def kth_neighbour_radii(features: torch.Tensor, k: int = 3, chunk: int = 1024) -> torch.Tensor:
    """(N,) distance of each row to its k-th nearest other row (itself excluded), on the features' device."""
    if features.shape[0] <= k:
        raise ValueError(f"k={k} needs more than {k} feature vectors, got {features.shape[0]}")
    out = []
    for start in range(0, len(features), chunk):
        d = torch.cdist(features[start : start + chunk], features)  # (c, N)
        out.append(d.topk(k + 1, dim=1, largest=False).values[:, -1])  # the smallest is the row itself
    return torch.cat(out)


def _inside_any_ball(queries: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor, chunk: int) -> torch.Tensor:
    """(Q,) bool: query q lies within radii[j] of some centre j."""
    out = []
    for start in range(0, len(queries), chunk):
        d = torch.cdist(queries[start : start + chunk], centres)  # (c, M)
        out.append((d <= radii[None, :]).any(dim=1))
    return torch.cat(out)


def precision_recall(real: torch.Tensor, fake: torch.Tensor, k: int = 3, chunk: int = 1024,
                     device: torch.device | str | None = None, real_radii: torch.Tensor | None = None
                     ) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al. 2019) of ``fake`` against ``real`` features, k-NN balls.

    float32 on ``device`` (default: the features' own); pass ``real_radii`` (``kth_neighbour_radii(real, k)``)
    to reuse the real balls across many fake sets.
    """
    device = device or real.device
    real, fake = real.to(device, torch.float32), fake.to(device, torch.float32)
    radii_real = kth_neighbour_radii(real, k, chunk) if real_radii is None else real_radii.to(device, torch.float32)
    radii_fake = kth_neighbour_radii(fake, k, chunk)
    precision = _inside_any_ball(fake, real, radii_real, chunk).double().mean()
    recall = _inside_any_ball(real, fake, radii_fake, chunk).double().mean()
    return float(precision), float(recall)


def class_statistics(predicted: torch.Tensor, num_classes: int, requested: torch.Tensor | None = None) -> dict:
    """Histogram of predicted classes, max/min class share vs uniform 1/K, accuracy against ``requested`` labels."""
    predicted = predicted.long().cpu()
    hist = torch.bincount(predicted, minlength=num_classes)[:num_classes]
    share = hist.double() / max(1, len(predicted))
    out = {
        "class_histogram": hist.tolist(),
        "class_share_max": float(share.max()),
        "class_share_min": float(share.min()),
        "class_share_uniform": 1.0 / num_classes,
        "label_accuracy": None,
    }
    if requested is not None:
        out["label_accuracy"] = float((predicted == requested.long().cpu()).double().mean())
    return out


def inception_fid(real_uint8: torch.Tensor, fake_uint8: torch.Tensor, weights_path: str | None,
                  batch_size: int = 250) -> tuple[float | None, str]:
    """Standard FID (Inception-v3 pool features) via torchmetrics with local weights; (None, why) when unavailable."""
    if not weights_path:
        return None, "standard FID skipped: pass --inception_weights PATH (torchmetrics/torch-fidelity weights file)"
    if importlib.util.find_spec("torchmetrics") is None or importlib.util.find_spec("torch_fidelity") is None:
        return None, "standard FID skipped: torchmetrics and torch-fidelity are not installed"
    if not Path(weights_path).is_file():
        raise FileNotFoundError(f"--inception_weights {weights_path} does not exist; give the .pth file or drop it")
    from torchmetrics.image.fid import FrechetInceptionDistance

    device = "cuda" if torch.cuda.is_available() else "cpu"
    fid = FrechetInceptionDistance(feature=2048, feature_extractor_weights_path=weights_path).to(device)
    for images, real in ((real_uint8, True), (fake_uint8, False)):
        for start in range(0, len(images), batch_size):
            fid.update(images[start : start + batch_size].to(device), real=real)
    return float(fid.compute()), "standard FID: torchmetrics FrechetInceptionDistance, 2048-d pool features"
