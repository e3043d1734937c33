"""Image loading: mode/size normalisation, errors, the decode-once cache, CIFAR-10 parquet, device augmentation."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from hf_cgpu.data import images as images_mod
from hf_cgpu.data.images import augment_on_device, load_image_dataset, preprocess_image

CIFAR = Path("/work/shared/data/cifar10")


def _rgb(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


# ----------------------------------------------------------------------------- one image
def test_grayscale_becomes_three_equal_channels():
    grey = Image.fromarray(np.arange(32 * 32, dtype=np.uint16).reshape(32, 32).astype(np.uint8), mode="L")
    out = preprocess_image(grey)
    assert out.shape == (3, 32, 32) and out.dtype == np.uint8
    assert np.array_equal(out[0], np.asarray(grey)) and np.array_equal(out[0], out[2])


def test_rgba_transparent_pixels_become_white():
    arr = np.zeros((32, 32, 4), dtype=np.uint8)
    arr[..., 0] = 200  # red, but fully transparent on the left half
    arr[:, 16:, 3] = 255
    out = preprocess_image(Image.fromarray(arr, mode="RGBA"))
    assert np.all(out[:, :, :16] == 255)
    assert np.all(out[0, :, 16:] == 200) and np.all(out[1:, :, 16:] == 0)


def test_palette_and_16bit():
    pal = _rgb(32, 32).convert("P")
    assert np.array_equal(preprocess_image(pal), preprocess_image(pal.convert("RGB")))
    deep = Image.fromarray(np.full((32, 32), 65535, dtype=np.uint16))
    assert np.all(preprocess_image(deep) == 255)


def test_non_square_is_centre_cropped_then_resized():
    arr = np.zeros((32, 96, 3), dtype=np.uint8)
    arr[:, 32:64] = 255  # white centre square, black sides
    out = preprocess_image(Image.fromarray(arr))
    assert out.shape == (3, 32, 32) and np.all(out == 255)
    assert preprocess_image(_rgb(64, 64)).shape == (3, 32, 32)
    assert preprocess_image(_rgb(7, 5), image_size=16).shape == (3, 16, 16)


def _pillow_converts(mode: str) -> bool:
    try:
        Image.new(mode, (2, 2)).convert("RGBA")
        return True
    except ValueError:
        return False


@pytest.mark.skipif(_pillow_converts("La"), reason="this Pillow converts 'La', so there is no bad mode to try")
def test_unconvertible_mode_is_a_one_line_error():
    with pytest.raises(ValueError, match="convert those images first") as info:
        preprocess_image(Image.new("La", (8, 8)))
    assert "\n" not in str(info.value)


MODES = ["1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "I", "I;16", "F", "LAB", "HSV"]


def _make(mode: str, w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    if mode in ("LAB", "HSV", "La"):
        return Image.new(mode, (w, h), tuple(int(c) for c in rng.integers(0, 256, len(mode.replace(";", "")))))
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (h, w), dtype=np.uint16))
    if mode == "I":
        return Image.fromarray(rng.integers(-(2**20), 2**20, (h, w), dtype=np.int32))
    if mode == "F":
        return Image.fromarray(rng.normal(100, 200, (h, w)).astype(np.float32))
    base = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), mode="RGBA")
    return base if mode == "RGBA" else base.convert("RGB").convert(mode) if mode != "PA" else base.convert("PA")


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(MODES), w=st.integers(1, 80), h=st.integers(1, 80), seed=st.integers(0, 1000))
def test_fuzz_any_mode_and_size_gives_3x32x32_uint8(mode, w, h, seed):
    image = _make(mode, w, h, seed)
    try:
        out = preprocess_image(image)
    except ValueError as err:  # only modes Pillow cannot convert ('La' in Pillow 13), with the documented error
        assert mode == "La" and "convert those images first" in str(err)
        return
    assert out.shape == (3, 32, 32) and out.dtype == np.uint8


# ----------------------------------------------------------------------------- datasets and cache
def _write_parquet(folder: Path, split: str = "train") -> None:
    from datasets import ClassLabel, Dataset, Features
    from datasets import Image as ImageFeature

    imgs = [_rgb(32, 32, 0), _rgb(40, 24, 1).convert("L"), _rgb(32, 32, 2).convert("RGBA"), _rgb(16, 16, 3)]
    features = Features({"img": ImageFeature(), "label": ClassLabel(names=["cat", "dog"])})
    Dataset.from_dict({"img": imgs, "label": [0, 1, 1, 0]}, features=features).to_parquet(folder / f"{split}.parquet")


def test_parquet_folder_decode_and_cache(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    _write_parquet(data)
    cache = tmp_path / "cache"
    ds = load_image_dataset(str(data), cache_dir=cache)
    assert ds.images.shape == (4, 3, 32, 32) and ds.images.dtype == torch.uint8
    assert ds.labels.tolist() == [0, 1, 1, 0] and ds.labels.dtype == torch.int64
    assert ds.class_names == ["cat", "dog"] and ds.num_classes == 2
    assert Path(ds.cache_path).is_file() and ds.cache_path.endswith(".safetensors")

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again instead of reading the cache")

    monkeypatch.setattr(images_mod, "_decode_images", no_decoding)
    again = load_image_dataset(str(data), cache_dir=cache)
    assert torch.equal(again.images, ds.images) and again.class_names == ["cat", "dog"]
    limited_key = images_mod.cache_file(str(data), "train", "img", "label", 32, 2, cache)
    assert limited_key != Path(ds.cache_path)  # limit is part of the key: this would decode
    with pytest.raises(AssertionError, match="decoded again"):
        load_image_dataset(str(data), cache_dir=cache, limit=2)


def test_cache_key_follows_every_file_size_and_mtime(tmp_path):
    """An edited dataset gets a new key even when the edit keeps the mtime (copies, restores) or the size."""
    import os

    data = tmp_path / "data"
    data.mkdir()
    _write_parquet(data)
    (data / "extra.txt").write_bytes(b"12345")
    key = lambda: images_mod.cache_file(str(data), "train", "img", "label", 32, None, tmp_path / "c")  # noqa: E731
    before = key()
    assert key() == before  # deterministic
    stat = (data / "extra.txt").stat()
    (data / "extra.txt").write_bytes(b"123456")  # one byte more, same mtime
    os.utime(data / "extra.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    grown = key()
    assert grown != before
    (data / "extra.txt").write_bytes(b"654321")  # same size, another mtime
    os.utime(data / "extra.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 5 * 10**9))
    assert key() not in (before, grown)


def test_missing_image_column_names_the_columns_and_the_setting(tmp_path):
    _write_parquet(tmp_path)
    with pytest.raises(ValueError) as info:
        load_image_dataset(str(tmp_path / "train.parquet"), image_column="image", use_cache=False)
    message = str(info.value)
    assert "img, label" in message and "--image_column" in message and "\n" not in message


def test_imagefolder_without_labels_column_name(tmp_path):
    for cls, seed in (("cat", 0), ("dog", 1)):
        (tmp_path / "train" / cls).mkdir(parents=True)
        for i in range(2):
            _rgb(20, 20, seed * 10 + i).save(tmp_path / "train" / cls / f"{i}.png")
    ds = load_image_dataset(str(tmp_path), image_column="image", use_cache=False)
    assert ds.images.shape == (4, 3, 32, 32) and ds.class_names == ["cat", "dog"]
    assert sorted(ds.labels.tolist()) == [0, 0, 1, 1]


@pytest.mark.skipif(not (CIFAR / "train.parquet").is_file(), reason=f"{CIFAR}/train.parquet not present")
def test_cifar10_slice(tmp_path):
    ds = load_image_dataset(str(CIFAR), split="test", limit=256, cache_dir=tmp_path)
    assert ds.images.shape == (256, 3, 32, 32) and ds.labels.shape == (256,)
    assert ds.class_names[:2] == ["airplane", "automobile"] and len(ds.class_names) == 10
    assert 0 <= ds.labels.min() and ds.labels.max() <= 9 and len(set(ds.labels.tolist())) == 10
    assert 60 < ds.images.float().mean() < 200  # real photos, not zeros


# ----------------------------------------------------------------------------- augmentation
def test_augment_on_device_range_and_flips():
    x = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    x[:, :, :, 0], x[:, :, :, -1] = 0, 255  # left column black, right white
    out = augment_on_device(x, torch.Generator().manual_seed(0))
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert out.min() >= -1 and out.max() <= 1
    flipped = out[:, 0, 0, 0] == 1.0  # a flip puts the white column on the left
    assert 10 < int(flipped.sum()) < 54
    plain = x.float() / 127.5 - 1
    assert torch.equal(out[~flipped], plain[~flipped]) and torch.equal(out[flipped], plain[flipped].flip(3))
    again = augment_on_device(x, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    assert augment_on_device(x, dtype=torch.bfloat16).dtype == torch.bfloat16
