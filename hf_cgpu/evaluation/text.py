"""Language-model evaluation: loss, perplexity and bits per character over a whole split.

Every token of the split's stream (documents joined by EOS) is scored exactly once, with up to ``seq_len`` tokens
of context (``hf_cgpu.data.windows.eval_windows``), in fixed-shape batches (compiled models do not recompile);
instruction rows are scored in batches of similar length instead (``score_rows``).
Bits per character = summed cross-entropy in bits / characters of the split's documents: unlike loss per token it
does not depend on the tokenizer, so models with different vocabularies compare on one scale.

    hf-cgpu eval runs/gpt124m --dataset ../shared/data/zh-poetry
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..data.chat import prepare_chat
from ..data.corpus import BUILTIN, load_text_dataset, named_as_train
from ..data.instruct import build_rows, instruction_splits
from ..data.packing import pack_dataset
from ..data.windows import document_position_ids, eval_windows
from ..errors import ArgumentParser, about, run_main
from ..generate import load_causal_lm
from ..models.causal_lm_loss import causal_lm_loss_from_hidden, unwrap_model
from ..options import VERIFY_MODES
from ..settings import SettingsError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (inputs, shifted targets) -> mean loss


def score_stream(
    loss_fn: LossFn,
    data,
    seq_len: int,
    batch_size: int,
    device: torch.device | str,
    max_windows: int | None = None,
    prefix: str = "",
    progress: bool = False,
) -> dict[str, float]:
    """Score the token stream of ``data`` (a ``PackedTokens``) with ``loss_fn``.

    Returns ``{prefix}loss`` (mean nats per scored token), ``{prefix}perplexity``, ``{prefix}bpc`` (when the
    data knows its characters) and ``{prefix}tokens`` (tokens scored). ``max_windows`` caps the work (the bpc then
    uses the characters in proportion to the tokens scored). Deterministic: no sampling anywhere.
    """
    plan = eval_windows(data.n_tokens, seq_len)
    if max_windows is not None:
        plan = plan[:max_windows]
    if not plan:
        return {}
    window = seq_len + 1

    def batches():
        for first in range(0, len(plan), batch_size):
            chunk = plan[first : first + batch_size]
            starts = [s for s, _ in chunk]
            ids = data.windows(starts + [starts[0]] * (batch_size - len(chunk)), window)  # padded to a fixed shape
            targets = ids.clone()
            for row, (_, skip) in enumerate(chunk):
                targets[row, : skip + 1] = -100  # position 0 is context; ``skip`` were scored by the last window
            targets[len(chunk) :] = -100  # padding rows
            yield ids, targets

    total, count = _score(loss_fn, batches(), device, -(-len(plan) // batch_size), progress)
    chars = data.n_chars * count / max(1, data.n_tokens - 1) if getattr(data, "n_chars", None) else None
    return _figures(total, count, chars, prefix)


def score_rows(loss_fn: LossFn, rows, batch_size: int, device, prefix: str = "", progress: bool = False) -> dict:
    """Score examples (``hf_cgpu.data.instruct.InstructionRows``) on their target tokens only: longest first, in
    batches of ``batch_size`` cut after the batch's last target, so an example pads to its batch's longest one
    instead of ``seq_len`` (the figures are the same: a causal model's loss does not see the padding). One batch's
    logits at a time, at most; only the running sums are kept."""
    lengths = rows.lengths()
    order = torch.argsort(lengths, descending=True, stable=True)

    def batches():
        for first in range(0, len(rows), batch_size):
            take = order[first : first + batch_size]
            width = int(lengths[take].max())
            yield rows.ids[take, :width], rows.targets[take, :width]

    total, count = _score(loss_fn, batches(), device, -(-len(rows) // batch_size), progress)
    return _figures(total, count, rows.n_chars or None, prefix)


def _score(loss_fn: LossFn, batches, device, n_batches: int, progress: bool) -> tuple[float, int]:
    """Summed nats and count of scored targets; ``batches`` yields (ids, targets) of ``seq_len + 1`` columns."""
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, total=n_batches, desc="evaluating", unit="batch")
    total, count = 0.0, 0
    for ids, targets in batches:
        targets = targets[:, 1:]
        n = int((targets != -100).sum())
        if n == 0:
            continue
        loss = loss_fn(ids[:, :-1].to(device), targets.to(device))
        total += float(loss.double()) * n
        count += n
    return total, count


def _figures(total: float, count: int, chars: float | None, prefix: str) -> dict[str, float]:
    if count == 0:
        return {}
    mean = total / count
    out = {f"{prefix}loss": mean, f"{prefix}perplexity": math.exp(min(mean, 50.0)), f"{prefix}tokens": count}
    if chars:
        out[f"{prefix}bpc"] = total / math.log(2) / chars
    return out


def causal_lm_target_loss(model) -> LossFn:
    """Mean cross-entropy against shifted targets for any transformers causal LM (peft-wrapped too).

    Our GPT takes the targets directly (its chunked fp32 loss), with attention kept within each document when its
    config records ``document_masking`` (the run trained and validated so); other models go through their backbone and the
    chunked loss of ``hf_cgpu.models.causal_lm_loss``, so the (batch, seq, vocab) fp32 logits never exist at once.
    """
    config = unwrap_model(model).config
    if getattr(config, "model_type", None) == "cgpt":
        eos = config.eos_token_id if getattr(config, "document_masking", False) else None  # as the run validated
        return lambda x, y: cgpt_target_loss(model, x, y, eos)
    return lambda x, y: causal_lm_loss_from_hidden(model, x, y, shift=False)


def cgpt_target_loss(model, inputs: torch.Tensor, targets: torch.Tensor, document_eos: int | None = None) -> torch.Tensor:
    """Our GPT's mean loss against shifted ``targets`` (its chunked fp32 loss; in eval mode no logits are built);
    ``document_eos``: attention kept within the documents that this EOS id ends (``document_position_ids``)."""
    positions = None if document_eos is None else document_position_ids(inputs, document_eos)
    return model(input_ids=inputs, position_ids=positions, shift_labels=targets, use_cache=False,
                 return_logits=False).loss


def _context_length(config) -> int | None:
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def evaluate_language_model(
    model_dir: str,
    dataset: str,
    split: str = "validation",
    text_column: str = "text",
    seq_len: int = 0,
    batch_size: int = 8,
    max_windows: int = 0,
    device: str = "auto",
    cache_dir: str | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    data_format: str = "auto",
    verify: str = "auto",
) -> dict:
    """Load ``model_dir`` (a folder, an adapter folder or a Hub id) and its tokenizer, score ``split`` of ``dataset``:
    a text stream (``score_stream``), or instruction rows (messages, instruction/output or prompt/response columns,
    ``data_format`` auto or instruct) on their responses only, as the fine-tuning run scores them (``score_rows``;
    ``max_windows`` then counts examples)."""
    if split not in ("train", "validation"):
        raise SettingsError(f"--split {split!r}: choose train or validation")
    if batch_size < 1 or max_windows < 0 or seq_len < 0:
        raise SettingsError(f"--batch_size must be >= 1, --max_windows and --seq_len >= 0 (0 = all / the model's "
                            f"positions); got {batch_size}, {max_windows}, {seq_len}")
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise SettingsError(f"--device {device!r}: choose auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SettingsError(f"--device {device}: this machine has no CUDA GPU; use --device cpu (or auto)")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tokenizer, model = load_causal_lm(model_dir, trust_remote_code, dtype, verify=verify)
    model.to(dev).eval()
    context = _context_length(model.config)
    seq_len = seq_len or min(context or 1024, 2048)
    if context and seq_len > context:
        raise SettingsError(f"--seq_len {seq_len} exceeds the model's {context} positions; use --seq_len {context}")
    source = None if dataset == BUILTIN else dataset
    found = instruction_splits(source, data_format, text_column, tokenizer=tokenizer)
    if found is not None:  # as the fine-tuning run scores it: the responses only, one example per row
        splits, fmt = found
        rows_split = splits[split]
        n = len(rows_split) if not max_windows else min(max_windows, len(rows_split))
        _, append_eos = prepare_chat(tokenizer, model_dir, log=_stderr)  # the template and EOS a run would use
        rows = build_rows(rows_split.select(range(n)), tokenizer, seq_len, fmt, append_eos=append_eos)
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            scores = score_rows(causal_lm_target_loss(model), rows, batch_size, dev, progress=progress)
        return {"model": model_dir, "dataset": dataset, "split": split, "seq_len": seq_len, "format": fmt,
                "examples": n, "cut_at_seq_len": rows.n_truncated, "cut_before_response": rows.n_cut_to_prompt,
                "characters": rows.n_chars, **scores,
                "whole_split": n == len(rows_split)}
    whole = bool(named_as_train(source))  # files named one by one, none train* by name: scored whole, as named
    ds = load_text_dataset(source, text_column=text_column, carve=not whole)
    split, ds = (source, {source: ds["validation"]}) if whole else (split, ds)
    data = pack_dataset(ds[split], tokenizer, seq_len, cache_dir=cache_dir, text_column=text_column, split=split)
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        scores = score_stream(causal_lm_target_loss(model), data, seq_len, batch_size, dev,
                              max_windows=max_windows or None, progress=progress)
    return {"model": model_dir, "dataset": dataset, "split": split, "seq_len": seq_len,
            "documents": len(ds[split]), "characters": data.n_chars, **scores,
            "whole_split": not max_windows or scores.get("tokens") == data.n_tokens - 1}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv)


TEXT_MODE = ("Score a language model (a run's output_dir, a causal LM folder, an adapter folder, a .gguf file or a Hub "
             "id) on a split of text or instruction data: loss, perplexity and bits per character.")


def parser() -> ArgumentParser:
    """The text mode's flags (``hf-cgpu eval MODEL_DIR --dataset DATA``)."""
    p = ArgumentParser(prog="hf-cgpu eval", description=about(
        TEXT_MODE, "hf-cgpu eval runs/zh --dataset ../shared/data/zh-poetry --split validation",
        more=__doc__.split("\n\n", 1)[1].split("\n\n    hf-cgpu")[0]))
    p.add_argument("model_dir", help="a trained run's output_dir (or its best/ folder), any causal LM folder or Hub id")
    p.add_argument("--dataset", required=True, help="text data as for training: a folder of parquet/json/txt, files, a Hub id or builtin")
    p.add_argument("--split", default="validation", help="train or validation (a missing validation split is carved from train exactly as training does)")
    p.add_argument("--text_column", default="text", help="column holding the documents")
    p.add_argument("--seq_len", type=int, default=0, help="context per window (0 = the model's positions, at most 2048)")
    p.add_argument("--batch_size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--max_windows", type=int, default=0, help="score only the first this many windows (0 = the whole split)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--cache_dir", default=None, help="packed-token cache (default: the training cache)")
    p.add_argument("--trust_remote_code", action="store_true", help="allow the model's own code from its folder/repo")
    p.add_argument("--output_json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--data_format", default="auto", help="auto (instruction columns -> the responses, as the "
                   "fine-tuning run scores them; else text), instruct or text")
    p.add_argument("--verify", default="auto", choices=VERIFY_MODES, help="what of MODEL_DIR's manifest.json (and "
                   "an adapter's record of its base) is checked before it is read: auto (the sizes; the SHA-256 too up "
                   "to 512 MiB; an adapter's base always), sizes, full, or off (a folder edited by hand); see "
                   "docs/outputs.md")
    return p


def _main(argv: list[str] | None) -> int:
    a = parser().parse_args(argv)
    out = evaluate_language_model(a.model_dir, a.dataset, a.split, a.text_column, a.seq_len, a.batch_size,
                                  a.max_windows, a.device, a.cache_dir, a.trust_remote_code, data_format=a.data_format,
                                  verify=a.verify)
    text = json.dumps(out, indent=2)
    if a.output_json:
        Path(a.output_json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
