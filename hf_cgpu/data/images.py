"""Small-image datasets for flow matching: decode once into a uint8 tensor, cache it, augment on the device.

A small 32x32 UNet on a consumer GPU consumes images faster than PIL decoding plus per-image transforms in
DataLoader workers produce them on a desktop CPU (benchmarks/RESULTS.md). So every image is decoded once, converted
to RGB and brought to ``image_size`` x ``image_size``, and the whole set is stored as one (N, 3, S, S) uint8 tensor
(CIFAR-10: 150 MB) in a safetensors file keyed by source, split, columns, size and limit, which a second run loads
instead of decoding again. Batches are then indexed from that tensor (moved to the GPU once) and flipped / scaled there
(``augment_on_device``).

Sources:
    - a directory holding ``{split}.parquet`` (e.g. /work/shared/data/cifar10), or any folder ``datasets`` can read
      (parquet shards named by split, or an imagefolder tree ``train/<class>/*.png``; its columns are
      ``image`` and ``label``, so pass ``image_column="image"``),
    - a .parquet file or a list of them,
    - a Hub dataset id such as ``uoft-cs/cifar10`` (needs network the first time).

Odd images: every mode is converted to RGB (transparent pixels composited onto white, 16-bit grey scaled to
8 bits); non-square images are centre-cropped to a square, then any size is resized (bicubic) to ``image_size``.
Modes PIL cannot turn into RGB (e.g. premultiplied 'La') raise a one-line error.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from ..errors import DataError
from ..integrity import atomic_output
from ..paths import image_cache
from .files import check_files, explain_load_error

CACHE_VERSION = 2  # 2: labels checked, content hash in the metadata
_16BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


@dataclass
class ImageDataset:
    """Decoded images and labels, ready to move to a device.

    Attributes:
        images: (N, 3, S, S) uint8.
        labels: (N,) int64, or None when the dataset has no label column.
        class_names: names from a ClassLabel label feature, else None.
        cache_path: the safetensors file the tensors live in (None when caching was off).
    """

    images: torch.Tensor
    labels: torch.Tensor | None
    class_names: list[str] | None
    cache_path: str | None = None
    sha256: str = ""
    """Content hash of images and labels (``content_hash``; the resume fingerprint's data part)."""

    @property
    def content_hash(self) -> str:
        if not self.sha256:
            self.sha256 = content_hash(self.images, self.labels)
        return self.sha256

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def num_classes(self) -> int | None:
        """Class count for a class-conditional model (from the names, else the largest label + 1)."""
        if self.class_names is not None:
            return len(self.class_names)
        return None if self.labels is None else int(self.labels.max()) + 1


# ----------------------------------------------------------------------------- one image
def preprocess_image(image: Image.Image, image_size: int = 32) -> np.ndarray:
    """Any PIL image -> (3, S, S) uint8: RGB, centre-cropped to a square, resized to ``image_size``."""
    if image.width == 0 or image.height == 0:
        raise DataError(f"empty image of size {image.size}; remove it from the dataset")
    rgb = _to_rgb(image)
    side = min(rgb.size)
    if rgb.width != rgb.height:
        left, top = (rgb.width - side) // 2, (rgb.height - side) // 2
        rgb = rgb.crop((left, top, left + side, top + side))
    if side != image_size:
        rgb = rgb.resize((image_size, image_size), Image.Resampling.BICUBIC)
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1).copy()  # (3, S, S)


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB view of ``image``; transparency goes onto white because hidden pixels often hold arbitrary colours."""
    try:
        return _convert(image)
    except ValueError as err:
        message = f"cannot convert image mode {image.mode!r} to RGB ({err}); convert those images first"
        raise DataError(message) from None


def _convert(image: Image.Image) -> Image.Image:
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _16BIT_MODES:
        grey = np.clip(np.asarray(image, dtype=np.float64) / 257.0, 0, 255).astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    if mode == "F":
        return Image.fromarray(np.clip(np.asarray(image), 0, 255).astype(np.uint8), mode="L").convert("RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _decode_images(images: Sequence[Image.Image], image_size: int) -> np.ndarray:
    """(n, 3, S, S) uint8 from a batch of PIL images."""
    return np.stack([preprocess_image(img, image_size) for img in images])


# ----------------------------------------------------------------------------- datasets
def _is_local(source: str | Sequence[str]) -> bool:
    if not isinstance(source, str):
        return True
    return os.path.exists(source)


def _local_files(source: str | Sequence[str], split: str) -> list[Path] | None:
    """The local files ``_open_dataset`` reads for ``split`` (None: a Hub id, or a folder ``datasets`` lays out)."""
    if not isinstance(source, str):
        return [Path(p) for p in source]
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        named = path / f"{split}.parquet"
        if named.is_file():
            return [named]
        shards = sorted(p for p in path.rglob("*.parquet") if split in p.name or split in p.parent.name)
        return shards or None
    return None


def _open_dataset(source: str | Sequence[str], split: str):
    """A ``datasets.Dataset`` for one split of a local folder/file(s) or a Hub id."""
    from datasets import load_dataset

    files = _local_files(source, split)
    if files:
        check_files(files, split)  # 0-byte, unreadable or 0-row parquet: one line naming the file
    if isinstance(source, str) and Path(source).is_file() and Path(source).suffix != ".parquet":
        raise DataError(f"{source} is not a .parquet file; pass a parquet file, a folder or a Hub id")
    try:
        if not isinstance(source, str):
            return load_dataset("parquet", data_files={split: [str(p) for p in source]}, split=split)
        path = Path(source)
        if path.is_file():
            return load_dataset("parquet", data_files={split: str(path)}, split=split)
        if path.is_dir():
            named = path / f"{split}.parquet"
            if named.is_file():
                return load_dataset("parquet", data_files={split: str(named)}, split=split)
            return load_dataset(str(path), split=split)  # datasets infers parquet shards or an imagefolder
    except (Exception, StopIteration) as err:
        missing = _missing_split(err, source, split)
        raise (missing or explain_load_error(err, files or [source])) from err
    try:
        return load_dataset(source, split=split)
    except Exception as err:  # no such path or Hub id, offline, no such split: one line naming the fix
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"cannot load split {split!r} of {source!r} ({type(err).__name__}: {first[:160]}); "
                        "pass an existing folder of parquet files, a .parquet file or a Hub dataset id") from err


def _missing_split(err: BaseException, source: str | Sequence[str], split: str) -> DataError | None:
    """The one line for a folder that has no ``split`` (``datasets``' "Unknown split"), naming the splits it has and
    the file or folder to add; None for other errors."""
    cause: BaseException | None = err
    while cause is not None and "Unknown split" not in str(cause):
        cause = cause.__cause__ or cause.__context__
    if cause is None or not isinstance(source, str):
        return None
    found = re.search(r"one of (\[.*?\])", str(cause))
    has = ", ".join(re.findall(r"'([^']+)'", found.group(1))) if found else "others"
    role = " (the held-out images this task evaluates on)" if split == "test" else ""
    return DataError(f"{source} has no {split} split{role}: no {split}.parquet and no {split}/ folder of images "
                     f"(splits found: {has}); add one, e.g. {Path(source) / f'{split}.parquet'}")


def _file_fingerprint(source: str | Sequence[str]) -> list:
    """Sizes and mtimes of local files so an edited dataset gets a new cache key."""
    paths = [Path(source)] if isinstance(source, str) else [Path(p) for p in source]
    files = []
    for p in paths:
        files += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return [[str(f.resolve()), f.stat().st_size, int(f.stat().st_mtime)] for f in files[:10000]]


def cache_file(
    source: str | Sequence[str],
    split: str,
    image_column: str,
    label_column: str | None,
    image_size: int,
    limit: int | None,
    cache_dir: str | os.PathLike,
) -> Path:
    """Where the decoded tensors for these arguments live."""
    local = _is_local(source)
    key = {
        "v": CACHE_VERSION,
        "source": [str(Path(s).resolve()) for s in ([source] if isinstance(source, str) else source)]
        if local
        else source,
        "files": _file_fingerprint(source) if local else None,
        "split": split,
        "image_column": image_column,
        "label_column": label_column,
        "image_size": image_size,
        "limit": limit,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = Path(source if isinstance(source, str) else source[0]).name.replace(".parquet", "") or "dataset"
    return Path(cache_dir) / f"{name}-{split}-{image_size}px-{limit or 'all'}-{digest}.safetensors"


def load_image_dataset(
    source: str | Sequence[str],
    split: str = "train",
    image_column: str = "img",
    label_column: str | None = "label",
    limit: int | None = None,
    image_size: int = 32,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    batch_size: int = 1000,
) -> ImageDataset:
    """Decode ``split`` of ``source`` once into (N, 3, S, S) uint8 (+ int64 labels), cached as safetensors.

    ``label_column`` missing from the data (or None) gives ``labels=None``: an unconditional dataset.
    ``limit`` keeps the first rows only (quick runs, tests). ``cache_dir`` defaults to ``paths.image_cache()``.
    """
    path = cache_file(source, split, image_column, label_column, image_size, limit, cache_dir or image_cache())
    if use_cache and path.is_file():
        return _read_cache(path)
    data = _decode_dataset(source, split, image_column, label_column, limit, image_size, batch_size)
    if use_cache:
        _write_cache(path, data)
        data.cache_path = str(path)
    return data


def describe_source(source, split: str) -> str:
    """The files a split is read from, for error messages."""
    files = _local_files(source, split) if not isinstance(source, str) or os.path.exists(source) else None
    return ", ".join(map(str, files)) if files else f"{source} ({split})"


def _open_image(value) -> Image.Image:
    """A PIL image from what an undecoded ``datasets.Image`` column holds (bytes and/or a path), fully read."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict) and value.get("bytes") is not None:
        image = Image.open(io.BytesIO(value["bytes"]))
    elif isinstance(value, dict) and value.get("path"):
        image = Image.open(value["path"])
    else:
        raise ValueError(f"no image bytes or path ({type(value).__name__})")
    image.load()  # a truncated or corrupt file fails here, not later
    return image


def _image_file(value) -> str | None:
    """The local file an undecoded image was read from (an imagefolder's PNG), None for bytes stored in a table."""
    path = value.get("path") if isinstance(value, dict) else None
    return path if path and value.get("bytes") is None and os.path.isfile(path) else None


def _decode_rows(ds, image_column: str, image_size: int, batch_size: int, where: str, offset: int = 0) -> np.ndarray:
    """(n, 3, S, S) uint8; an image that does not decode is named in one line: its file when it has one (an
    imagefolder), else its row."""
    from datasets import Image as ImageFeature

    if isinstance(ds.features[image_column], ImageFeature):
        ds = ds.cast_column(image_column, ImageFeature(decode=False))
    chunks, row = [], offset
    for batch in ds.select_columns([image_column]).iter(batch_size=batch_size):
        opened, names = [], []
        for value in batch[image_column]:
            file = _image_file(value)
            what = f"{file} ({where} row {row})" if file else f"{where} row {row}"
            try:
                opened.append(_open_image(value))
            except Exception as err:  # PIL: UnidentifiedImageError, OSError (truncated), SyntaxError (broken PNG)
                why = str(err).split(" <_io.")[0][:120]  # PIL names the buffer object, which says nothing
                fix = "remove or replace that file" if file else "remove or replace that row"
                raise DataError(f"{what}: the image does not decode ({type(err).__name__}: {why}); {fix}") from None
            names.append(what)
            row += 1
        try:
            chunks.append(_decode_images(opened, image_size))
        except DataError:  # which image: one at a time
            for image, what in zip(opened, names):
                try:
                    preprocess_image(image, image_size)
                except DataError as err:
                    raise DataError(f"{what}: {err}") from None
            raise
    empty = np.zeros((0, 3, image_size, image_size), dtype=np.uint8)
    return np.concatenate(chunks) if chunks else empty


def check_labels(labels: torch.Tensor, names: list[str] | None, where: str,
                 num_classes: int | None = None) -> None:
    """Class ids are 0..K-1: none negative, none past the class names (or ``num_classes``, the training split's),
    and without names no id beyond a gap (one stray id would silently add classes)."""
    if labels.numel() == 0:
        return
    bad = torch.nonzero(labels < 0)
    if len(bad):
        row = int(bad[0])
        raise DataError(f"{where} row {row}: label {int(labels[row])} is negative; labels are class ids 0..K-1")
    limit = num_classes if num_classes is not None else (len(names) if names is not None else None)
    if limit is not None:
        bad = torch.nonzero(labels >= limit)
        if len(bad):
            row = int(bad[0])
            raise DataError(f"{where} row {row}: label {int(labels[row])} is outside the {limit} classes "
                            f"(0..{limit - 1}){' of the training split' if num_classes is not None else ''}; "
                            "fix that row")
        return
    present = torch.unique(labels).tolist()
    if present[-1] != len(present) - 1:  # ids are not 0..K-1: find the first id past a gap
        missing = next(i for i in range(present[-1] + 1) if i not in set(present))
        beyond = min(v for v in present if v > missing)
        row = int(torch.nonzero(labels == beyond)[0])
        raise DataError(f"{where} row {row}: label {beyond} is outside the range of the others (class {missing} "
                        f"never occurs); fix that row, or use a ClassLabel column naming every class")


def _decode_dataset(source, split, image_column, label_column, limit, image_size, batch_size) -> ImageDataset:
    from datasets import ClassLabel

    ds = _open_dataset(source, split)
    where = describe_source(source, split)
    if image_column not in ds.column_names:
        raise DataError(
            f"no image column {image_column!r} in {source} (columns: {', '.join(ds.column_names)});"
            " set --image_column to one of them"
        )
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    if len(ds) == 0:
        raise DataError(f"{where}: the {split} split has 0 rows; fill it or point --dataset at data with images")
    has_labels = label_column is not None and label_column in ds.column_names
    images = torch.from_numpy(_decode_rows(ds, image_column, image_size, batch_size, where))  # (N, 3, S, S)
    feature = ds.features[label_column] if has_labels else None
    names = list(feature.names) if isinstance(feature, ClassLabel) else None
    labels = None
    if has_labels:
        raw = list(ds[label_column])
        missing = [i for i, v in enumerate(raw) if v is None]
        if missing:
            raise DataError(f"{where} row {missing[0]}: no label; fill it or pass --label_column of another column")
        try:
            labels = torch.tensor(raw, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError):
            row = next(i for i, v in enumerate(raw) if not isinstance(v, (int, np.integer)))
            raise DataError(f"{where} row {row}: label {raw[row]!r} is no integer class id") from None
        check_labels(labels, names, where)
    return ImageDataset(images=images, labels=labels, class_names=names, sha256=content_hash(images, labels))


def content_hash(images: torch.Tensor, labels: torch.Tensor | None) -> str:
    """SHA-256 of the decoded pixels and labels: the data's content, whatever path or cache it came through."""
    digest = hashlib.sha256(images.contiguous().numpy().tobytes())
    digest.update(b"labels" + (labels.numpy().tobytes() if labels is not None else b""))
    return digest.hexdigest()


def _write_cache(path: Path, data: ImageDataset) -> None:
    """Atomic write (tmp + rename) so an interrupted run never leaves a truncated cache behind."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"images": data.images.contiguous()}
    if data.labels is not None:
        tensors["labels"] = data.labels

    with atomic_output(path) as tmp:
        save_file(tensors, str(tmp), metadata={"class_names": json.dumps(data.class_names),
                                               "sha256": data.content_hash})


def _read_cache(path: Path) -> ImageDataset:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        names = json.loads(meta.get("class_names", "null"))
        images = f.get_tensor("images")
        labels = f.get_tensor("labels") if "labels" in f.keys() else None
    return ImageDataset(images=images, labels=labels, class_names=names, cache_path=str(path),
                        sha256=meta.get("sha256", ""))


# ----------------------------------------------------------------------------- augmentation
def to_device_async(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU index tensor on ``device`` without a host sync: a plain ``.to(cuda)`` of pageable memory waits for every
    kernel queued before it (the whole previous step's optimizer and EMA), so the GPU idles while Python builds the
    next step. Pinned and non-blocking, the copy joins the queue instead."""
    if getattr(device, "type", str(device)) != "cuda" or indices.device.type != "cpu":
        return indices.to(device)
    return indices.pin_memory().to(device, non_blocking=True)


def augment_on_device(
    x_uint8: torch.Tensor, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(B, C, H, W) uint8 -> ``dtype`` in [-1, 1] with a random horizontal flip per image.

    Runs wherever ``x_uint8`` lives (index the cached tensor on the GPU, then call this), so the CPU is not the
    bottleneck. A ``generator`` must be on the same device as ``x_uint8``.
    """
    x = x_uint8.to(dtype) / 127.5 - 1.0  # (B, C, H, W) in [-1, 1]
    flip = torch.rand(x.shape[0], device=x.device, generator=generator) < 0.5  # (B,)
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def random_crop_on_device(
    x: torch.Tensor, padding: int, generator: torch.Generator | None = None, mode: str = "reflect"
) -> torch.Tensor:
    """(B, C, H, W) float -> the same shape: pad by ``padding`` (reflect), crop back at a random offset per image.

    One gather on ``x``'s device, no per-image Python loop. ``padding`` 0 returns ``x``.
    """
    if padding <= 0:
        return x
    b, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (padding,) * 4, mode=mode)  # (B, C, H + 2p, W + 2p)
    dy, dx = torch.randint(0, 2 * padding + 1, (2, b, 1), device=x.device, generator=generator)  # (B, 1) each
    rows = (dy + torch.arange(h, device=x.device))[:, None, :, None]  # (B, 1, H, 1)
    cols = (dx + torch.arange(w, device=x.device))[:, None, None, :]  # (B, 1, 1, W)
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    chans = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch, chans, rows, cols]  # (B, C, H, W)
