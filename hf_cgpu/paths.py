"""Where hf_cgpu keeps what it can rebuild: one cache root and a folder per kind of cached thing.

Everything lives under ``$HF_CGPU_CACHE`` (default ``~/.cache/hf_cgpu``), outside any output folder, so runs on the
same data share one copy and deleting the root only costs the time to rebuild it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "HF_CGPU_CACHE"


def cache_dir() -> Path:
    """``$HF_CGPU_CACHE`` if set, else ``~/.cache/hf_cgpu``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_cgpu"


def packed_cache() -> Path:
    """Packed token streams (``tokens-<key>.bin`` + ``.json``), keyed by tokenizer, data and sequence length."""
    return cache_dir() / "packed"


def tokenizer_cache(root: str | os.PathLike | None = None) -> Path:
    """Tokenizers trained by earlier runs, keyed by their data and settings; under ``root`` when one is given."""
    return (Path(root) if root else cache_dir()) / "tokenizers"


def image_cache() -> Path:
    """Image splits decoded once to uint8 arrays."""
    return cache_dir() / "images"


def feature_cache() -> Path:
    """Classifier features of real images, for image evaluation."""
    return cache_dir() / "features"


def gguf_cache() -> Path:
    """GGUF checkpoints de-quantised to safetensors, one folder per file."""
    return cache_dir() / "gguf"


def bench_file() -> Path:
    """The last ``hf-cgpu bench`` result of this machine."""
    return cache_dir() / "bench.json"


__all__ = ["CACHE_ENV", "bench_file", "cache_dir", "feature_cache", "gguf_cache", "image_cache", "packed_cache",
           "tokenizer_cache"]
