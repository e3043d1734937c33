"""The byte-level BPE tokenizer hf_cgpu trains (``tokenizers``), its content hash, and the cache of tokenizers trained
before from the same data and settings."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DataError
from ..integrity import atomic_dir, atomic_write_json, build_manifest, write_manifest
from ..paths import tokenizer_cache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"

# Pre-tokenizer. GPT-2's regex (the ByteLevel default) already keeps a run of Han characters together, but it
# cuts the CJK punctuation and the newline that end every line of Chinese verse into separate pieces, so merges
# can never join "光" with "，\n". Measured on zh-poetry (full train set, vocab 32000): 1.27 characters per token
# with GPT-2's regex, 1.52 with this one (a CJK run may carry its trailing CJK punctuation and one newline);
# isolating every Han character gives 0.96 and cannot even fill a 32000 vocab. Non-CJK text is split exactly as
# GPT-2 splits it.
_HAN = (
    "\u2e80-\u2fdf"  # radicals
    "\u3005-\u3007\u3021-\u3029"  # 々 〆 〇, Hangzhou numerals
    "\u3040-\u30ff\u3100-\u312f\u3190-\u31ff"  # kana, bopomofo, kanbun
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # ext A, unified, compatibility ideographs
    "\U00020000-\U0003ffff"  # ext B..H
)
_CJK_PUNCT = (
    "\u3000-\u3004\u3008-\u3020\u3030-\u303f"  # ideographic space, 、。〈〉《》「」『』【】〔〕 ...
    "\uff01-\uff0f\uff1a-\uff20\uff3b-\uff40\uff5b-\uff65"  # fullwidth ！（），：；？ ...
    "\u00b7\u2014\u2018\u2019\u201c\u201d\u2026"  # · — ‘ ’ “ ” …
)
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PRETOKENIZE_PATTERN = f"[{_HAN}]+[{_CJK_PUNCT}]*\\n?|" + _GPT2_PATTERN



def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    min_frequency: int = 2,
    show_progress: bool = True,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer; returns a ``transformers.PreTrainedTokenizerFast``.

    Byte level: the 256 byte symbols are the initial alphabet, so any Unicode string encodes without an unknown
    token and ``decode(encode(text)) == text``. ``<|endoftext|>`` is token 0 and serves as eos, bos, unk and pad
    (the GPT config's ``eos_token_id`` default). The pre-tokenizer (``PRETOKENIZE_PATTERN``) keeps CJK runs whole
    so merges form whole characters, common words and line endings. Training on a large corpus takes minutes on a
    CPU: pass a sample of documents for quick runs.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise DataError(f"vocab_size={vocab_size} is below 257 (256 bytes + {EOS_TOKEN}); use e.g. 8000 or 32000")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    length = len(texts) if hasattr(texts, "__len__") else None
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,  # would rewrite " ," to "," and break the round trip
    )


def check_vocab(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """Refuse a model whose embedding table is smaller than the tokenizer: ids past it crash on the GPU with an
    opaque device-side assert. A larger table (padded to a multiple of 64 for speed) is fine."""
    n = len(tokenizer)
    if n > vocab_size:
        raise DataError(
            f"tokenizer has {n} tokens but the model's vocab_size is {vocab_size}; set --vocab_size {n} (or more) "
            f"or train the tokenizer with vocab_size {vocab_size}"
        )


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """Content hash of a tokenizer: its full serialized form when it is a fast tokenizer, else its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        content = backend.to_str()
    else:
        content = json.dumps(tokenizer.get_vocab(), sort_keys=True, ensure_ascii=False)
    content += f"|eos={tokenizer.eos_token_id}|n={len(tokenizer)}"
    return hashlib.sha256(content.encode("utf-8")).hexdigest()[:16]



TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json")
"""The JSON files of a saved tokenizer that say what its tokens are; ``tokenizer_config.json`` names its eos token."""


def tokenizer_problem(folder: str | os.PathLike) -> str | None:
    """What is wrong with the tokenizer files in ``folder``, naming the file ("<folder>/tokenizer_config.json is
    missing"); None: they are all there and parse (or ``folder`` is no local folder, e.g. a Hub id)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    if not (folder / "tokenizer_config.json").is_file():
        return f"{folder / 'tokenizer_config.json'} is missing"
    for name in TOKENIZER_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            return f"{path} is unreadable ({' '.join(str(err).split())[:120]})"
    return None


def no_eos_message(tokenizer: PreTrainedTokenizerBase, what: str = "tokenizer") -> str:
    """Why ``tokenizer`` has no eos token, naming the file at fault when it was loaded from a folder."""
    source = str(getattr(tokenizer, "name_or_path", "") or "")
    problem = tokenizer_problem(source) if source else None
    if problem:
        return (f"{problem}, so the {what} has no eos_token; copy that file back from where the tokenizer was saved "
                "(a model folder or best/), or pass a complete tokenizer folder")
    return (f"the {what}{f' {source}' if source else ''} has no eos_token; set one (eos_token in its "
            "tokenizer_config.json, or tokenizer.eos_token = '<|endoftext|>')")


def load_tokenizer(source: str | os.PathLike, what: str = "tokenizer", **kwargs: Any) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(source)`` that refuses, in one line naming the file, a tokenizer that cannot be
    read or that has no eos token (what a lost ``tokenizer_config.json`` leaves: a vocabulary without specials)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), **kwargs)
    except Exception as err:  # json, tokenizers and OS errors alike, none of which names the file
        problem = tokenizer_problem(source) or f"{source} cannot be read ({' '.join(str(err).split())[:160]})"
        raise DataError(f"{what}: {problem}; copy the tokenizer files back from where it was saved, or pass "
                        "another tokenizer") from None
    if tokenizer.eos_token_id is None:
        raise DataError(no_eos_message(tokenizer, what))
    return tokenizer


TOKENIZER_KEY = "hf_cgpu_tokenizer.json"
"""Beside a tokenizer hf_cgpu trained (in an output folder or the cache): what it was trained from."""
TOKENIZER_RECIPE = {"model": "byte-level BPE", "pretokenize": PRETOKENIZE_PATTERN, "min_frequency": 2,
                    "special_tokens": [EOS_TOKEN]}
"""What ``train_tokenizer`` does beyond its inputs: part of the tokenizer cache's key, so a change here (or in the
tokenizers version) trains anew instead of reusing a tokenizer made another way."""


def tokenizer_made_from(folder: Path) -> dict[str, Any] | None:
    """The ``TOKENIZER_KEY`` that ``save_tokenizer`` wrote beside the tokenizer in ``folder`` (None: none, or
    unreadable)."""
    try:
        return json.loads((folder / TOKENIZER_KEY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: Path, made_from: dict[str, Any]) -> None:
    """``tokenizer`` and what it was made from, written whole (a kill never leaves a 0-byte tokenizer_config.json)
    and sealed with a manifest, so ``hf-cgpu verify`` and a resume can tell its files were not changed."""
    with atomic_dir(folder) as tmp:
        tokenizer.save_pretrained(str(tmp))
        atomic_write_json(tmp / TOKENIZER_KEY, made_from)
        write_manifest(tmp, build_manifest(tmp, "tokenizer"))


def cached_tokenizer(key: dict[str, Any], cache_dir: str | os.PathLike | None,
                     train: Callable[[], PreTrainedTokenizerFast]) -> tuple[PreTrainedTokenizerFast, Path | None]:
    """The tokenizer an earlier run trained from the same ``key`` (the data's fingerprint and the settings), from
    ``<cache>/tokenizers/bpe-<hash>`` (``<cache>``: ``cache_dir`` or ``$HF_CGPU_CACHE``, as the packed tokens), with
    the folder it came from; else ``train()``'s, stored there for the next run (None: trained now), so a fresh
    ``--output_dir`` does not train it again; a damaged entry is trained again and replaced, a read-only or full cache
    only costs the training."""
    import tokenizers
    from transformers import AutoTokenizer

    full = {**key, **TOKENIZER_RECIPE, "tokenizers": tokenizers.__version__}
    digest = hashlib.sha256(json.dumps(full, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]
    folder = tokenizer_cache(cache_dir) / f"bpe-{digest}"
    if tokenizer_made_from(folder) == full:
        try:
            tok = AutoTokenizer.from_pretrained(str(folder))
            if tok.eos_token_id is not None:  # none: its tokenizer_config.json was lost
                return tok, folder
        except Exception:  # damaged on disk (json and tokenizers errors alike): trained again and replaced
            pass
    tok = train()
    try:
        save_tokenizer(tok, folder, full)
    except OSError:
        pass
    return tok, None


__all__ = ["EOS_TOKEN", "PRETOKENIZE_PATTERN", "TOKENIZER_FILES", "TOKENIZER_KEY", "TOKENIZER_RECIPE",
           "cached_tokenizer", "check_vocab", "load_tokenizer", "no_eos_message", "save_tokenizer", "tokenizer_hash",
           "tokenizer_made_from", "tokenizer_problem", "train_tokenizer"]
