"""Shared fixtures: tiny models saved locally, a synthetic image set (no downloads, no ../shared), isolated caches."""

import os

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

if os.environ.get("PYTEST_XDIST_WORKER"):
    # the workers share the machine's cores: one intra-op thread each, and in the commands they start (a test that
    # needs another count sets it)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Two workers where pytest-xdist is installed (the test extra) and no ``-n`` was given, each test file in one
    worker so that its module fixtures are made once; without xdist (or with ``-p no:xdist``, ``-n 0``) one process."""
    if (config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None) is None
            and not os.environ.get("PYTEST_XDIST_WORKER")):
        config.option.numprocesses = 2
        if config.getoption("dist", "no") == "no":
            config.option.dist = "loadfile"


def pytest_collection_modifyitems(config, items):
    """Two tiers. ``python -m pytest -q`` alone runs the fast one: tests marked ``slow`` (end-to-end runs, minutes
    each) are deselected. ``-m slow`` runs those, ``-m "slow or not slow"`` both; test files or ids named on the
    command line run whatever their tier."""
    if config.option.markexpr or config.args_source is not pytest.Config.ArgsSource.TESTPATHS:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


TINY_VOCAB = 256


def tiny_neox_config() -> GPTNeoXConfig:
    return GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                         vocab_size=TINY_VOCAB, max_position_embeddings=64)


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory):
    """A random tiny GPTNeoX causal LM saved with save_pretrained."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("neox")
    GPTNeoXForCausalLM(tiny_neox_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """A tiny GPTNeoX base with a tokenizer trained on the built-in corpus (a fine-tuning run's --model)."""
    from hf_cgpu.data.corpus import builtin_corpus
    from hf_cgpu.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("neox_base")
    tok = train_tokenizer(builtin_corpus()[:20], vocab_size=400, show_progress=False)
    # width 64: at 32, bitsandbytes 0.50.2 fails packing 4-bit weights for CPU inference on AVX512-BF16 CPUs
    cfg = GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                        vocab_size=len(tok), max_position_embeddings=64, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    GPTNeoXForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture
def fused_adamw(monkeypatch):
    """The loop builds the optimizer it builds on CUDA (torch's fused AdamW, which skips a non-finite step on the
    device: the path where step k is read one step late) on the CPU too. No fork() after it: its OpenMP region hangs
    in a forked child."""
    from hf_cgpu import optim
    from hf_cgpu.train import prepare

    def build(*args, **kwargs):
        return optim.build_optimizer(*args, **{**kwargs, "fused": True})

    monkeypatch.setattr(prepare, "build_optimizer", build)


@pytest.fixture(params=["host", "device"])
def skip_on(request):
    """Where a non-finite step is skipped: on the host (read at once), or on the device (fused AdamW's found_inf,
    read one step late)."""
    if request.param == "device":
        request.getfixturevalue("fused_adamw")
    return request.param


# tests/upstream holds vendored mixin sources of transformers / diffusers: imported by our test modules, not collected.
collect_ignore = ["upstream"]

# ---------------------------------------------------------------------------------------------------- images
COLOURS = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48),
           (145, 30, 180), (70, 240, 240), (240, 50, 230), (128, 128, 0), (255, 255, 255)]


def small_text_corpus(root, docs, tokenizers=("tok",)):
    """``root/data`` (train: docs 0-14, validation: docs 15-29, parquet) and a 300-token tokenizer per name in
    ``tokenizers`` (the first trained on docs 0-39, each next one on the following docs); returns ``root``."""
    import datasets

    from hf_cgpu.data.tokenizer import train_tokenizer

    data = root / "data"
    data.mkdir()
    for split, part in (("train", docs[:15]), ("validation", docs[15:30])):
        datasets.Dataset.from_dict({"text": part}).to_parquet(data / f"{split}.parquet")
    for i, name in enumerate(tokenizers):
        part = docs[:40] if i == 0 else docs[40 * i:]
        train_tokenizer(part, vocab_size=300, show_progress=False).save_pretrained(root / name)
    return root


def synthetic_images(n: int, seed: int):
    """Class k = a 32x32 image of colour k, a darker square at a random place, and pixel noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    images, labels = [], []
    for i in range(n):
        k = i % 10
        arr = np.array(COLOURS[k], dtype=np.float64)[None, None, :].repeat(32, 0).repeat(32, 1)
        y, x = rng.integers(0, 20, 2)
        arr[y : y + 12, x : x + 12] *= 0.5
        arr += rng.normal(0, 20, arr.shape)
        images.append(Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)))
        labels.append(k)
    return images, labels


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory):
    """A CIFAR-10-shaped parquet folder (train 300, test 105 images, ten colour classes c0..c9): the flow and
    classifier tasks, sample grids and pipeline saving run without ../shared/data."""
    from datasets import ClassLabel, Dataset, Features
    from datasets import Image as ImageFeature

    folder = tmp_path_factory.mktemp("synthetic")
    features = Features({"img": ImageFeature(), "label": ClassLabel(names=[f"c{k}" for k in range(10)])})
    for split, n, seed in (("train", 300, 0), ("test", 105, 1)):
        images, labels = synthetic_images(n, seed)
        Dataset.from_dict({"img": images, "label": labels}, features=features).to_parquet(folder / f"{split}.parquet")
    return folder


@pytest.fixture(scope="session")
def shared_gguf_cache(tmp_path_factory):
    """One folder of de-quantised GGUF checkpoints for the whole session: each is a pure function of its file (tens of
    seconds to make), so every module's own cache links its ``gguf/`` here."""
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module", autouse=True)
def isolated_cache(tmp_path_factory, shared_gguf_cache):
    """hf_cgpu's caches (decoded images, features, packed tokens, bench) in a temporary folder, not ~/.cache; only
    de-quantised GGUF checkpoints are shared (``shared_gguf_cache``)."""
    cache = tmp_path_factory.mktemp("cache")
    (cache / "gguf").symlink_to(shared_gguf_cache, target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_CGPU_CACHE", str(cache))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny models gain
    nothing from more and stall on a shared machine, and a child forked after a multi-threaded MKL matmul hangs in its
    first matmul (GNU OpenMP's thread pool does not survive fork()), so forked children and their parent's reference
    runs compute alike."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
