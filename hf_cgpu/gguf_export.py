"""``hf-cgpu export DIR --gguf``: a fine-tuned run (a LoRA/QLoRA adapter over its base, merged here in fp32) or a model
folder, written as one GGUF file for llama.cpp and Ollama, with its tokenizer and chat template.

The file is laid out as llama.cpp's ``convert_hf_to_gguf.py`` lays out a llama model, through the ``gguf`` package's
writer: tensor names from ``gguf.TensorNameMap``, q/k rows (weights and biases) permuted to llama.cpp's rotary
layout, the head width as ``attention.key_length``/``value_length`` (it may differ from hidden/heads), 1-D tensors in
f32, a byte-level BPE vocabulary (``tokenizer.ggml.model = gpt2``, its pre-tokenizer named, token types, merges,
special ids and the chat template through ``gguf.SpecialVocab``). A llama whose layout llama.cpp's llama
architecture cannot express (another activation, scaled rotary positions) is refused before anything is written.

The check: the written file is loaded back by transformers (``from_pretrained(..., gguf_file=)``, its optional
biases read where the file has them, as llama.cpp reads them) and its logits compared with the model's before the
file takes its name: every tensor must be the model's rounded to the outtype bit for bit, the config the same, the
logits within the outtype's rounding and the chat template kept, or nothing is left behind and the command exits 2.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError, IntegrityError, MissingPathError, SettingsError, about
from .finetune import merged_model
from .generate import adapter_base
from .hub.push import GGUF_DIR
from .integrity import FileEntry, Manifest, atomic_output, read_manifest, sha256_file, write_manifest
from .options import VERIFY_MODES, check_choice
from .settings import build_parser
from .verify import check_saved

OUTTYPES = {"bf16": ("BF16", "MOSTLY_BF16", 0.05), "f16": ("F16", "MOSTLY_F16", 0.02),
            "q8_0": ("Q8_0", "MOSTLY_Q8_0", 0.1)}
"""--outtype -> (gguf.GGMLQuantizationType of the matrices, gguf.LlamaFileType of the file, the largest logit
difference the check accepts as a fraction of the largest logit: a few times the rounding of a real model, far below
what a misplaced tensor does)."""

ARCHITECTURES = {"llama": "LLAMA"}
"""config.model_type -> gguf.MODEL_ARCH: the llama family (SmolLM2, Llama 3 and their fine-tunes)."""

PRE_TOKENIZERS = {
    "gpt-2": [{"type": "ByteLevel", "use_regex": True}],
    "smollm": [{"type": "Digits", "individual_digits": True}, {"type": "ByteLevel", "use_regex": True}],
}
"""llama.cpp's name of a byte-level pre-tokenizer -> the steps of tokenizer.json's ``pre_tokenizer`` it stands for
(each step: the keys that must match). Llama 3's regex split is recognised through transformers' own table."""


@dataclass(frozen=True)
class ExportSettings:
    """What ``hf-cgpu export`` writes."""

    gguf: bool = False
    """Write a GGUF file (llama.cpp, Ollama); the only format so far, so required."""
    outtype: str = field(default="bf16", metadata={"choices": lambda: tuple(OUTTYPES)})
    """Precision of the matrices: bf16 (the trained weights to bf16), f16, or q8_0 (8-bit blocks, half the size);
    norms stay f32."""
    output: str = ""
    """The .gguf file to write (default: DIR/gguf/<name>-<outtype>.gguf, a folder Ollama's Modelfile can name, sealed
    by gguf/manifest.json for `hf-cgpu push DIR REPO --include_gguf`)."""
    check: bool = True
    """Load the file back with transformers before it takes its name: every tensor must be the model's in --outtype
    bit for bit, the config and chat template the same, the logits close; otherwise nothing is written (exit 2)."""
    trust_remote_code: bool = False
    """Allow the base model's own code from its repository."""
    verify: str = field(default="auto", metadata={"choices": lambda: VERIFY_MODES})
    """What of MODEL_DIR's manifest.json (and an adapter's record of its base) is checked before it is read: auto
    (the sizes; the SHA-256 too up to 512 MiB; an adapter's base always), sizes, full, or off (a folder edited by
    hand); see docs/outputs.md."""

    def __post_init__(self) -> None:
        check_choice("verify", self.verify, VERIFY_MODES)
        if self.outtype not in OUTTYPES:
            raise SettingsError(f"--outtype {self.outtype!r}: choose {', '.join(OUTTYPES)}")
        if self.output and not self.output.endswith(".gguf"):
            raise SettingsError(f"--output {self.output}: name a .gguf file")


def load_for_export(folder: Path, trust_remote_code: bool = False, verify: str = "auto"):
    """(model in fp32, the folder holding its tokenizer) of a model folder, or of an adapter folder merged in fp32
    into its base (a QLoRA adapter into its de-quantised nf4 weights, ``finetune.merge_base``). An architecture
    outside ``ARCHITECTURES`` is refused before any weight is read, and so is a folder (or an adapter's base) that
    fails its manifest (``verify``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_saved(folder, verify)
    adapter = (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file()
    if not adapter and not (folder / "config.json").is_file():
        raise MissingPathError(f"{folder} holds no config.json or adapter_config.json; pass a fine-tuning run's "
                               "output_dir, its merged/ folder or a model folder")
    source = adapter_base(folder, verify) if adapter else str(folder)
    check_architecture(AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code), folder)
    if not adapter:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                    trust_remote_code=trust_remote_code), folder
    recorded = folder / "base_model.json"
    tier = json.loads(recorded.read_text()).get("tier") if recorded.is_file() else None
    model = merged_model(folder, source, torch.float32, quantized=tier == "qlora", trust_remote_code=trust_remote_code)
    return model, folder if (folder / "tokenizer.json").is_file() else Path(source)


def check_architecture(config, folder: Path) -> None:
    """Refuse, in one line, a model the llama layout of the file cannot hold: another architecture, another
    activation than llama.cpp's SiLU gate, scaled or partial rotary positions, an odd head width."""
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        raise SettingsError(f"{folder} is a {kind} model; GGUF export writes the llama family only "
                            f"({', '.join(ARCHITECTURES)}: SmolLM2, Llama 3 and their fine-tunes)")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise SettingsError(f"{folder} uses {rope.get('rope_type') or rope.get('type')} rope scaling; GGUF export "
                            "writes plain rotary positions only")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise SettingsError(f"{folder} rotates part of each head (partial_rotary_factor "
                            f"{rope['partial_rotary_factor']}); GGUF export writes fully rotary heads only")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise SettingsError(f"{folder} uses the {config.hidden_act} activation; llama.cpp's llama architecture "
                            "gates its MLP with silu, so GGUF export writes silu models only")
    if _head_dim(config) % 2:
        raise SettingsError(f"{folder} has heads of odd width {_head_dim(config)}; rotary positions need an even one")


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def write_gguf(model, tokenizer_dir: Path, path: Path, outtype: str = "bf16", name: str = "",
               check: bool = False) -> dict[str, Any]:
    """``model`` (a llama-family causal LM) and the tokenizer of ``tokenizer_dir`` as the GGUF file ``path``;
    returns ``tensors`` (how many were written) and, with ``check``, ``compare_logits``'s figures. The file takes
    its name only once written (and, with ``check``, read back within the outtype's tolerance): a failed check
    raises ``CheckpointError`` and leaves ``path`` as it was."""
    import gguf
    from transformers import AutoTokenizer

    cfg = model.config
    qtype, ftype = (getattr(gguf.GGMLQuantizationType, OUTTYPES[outtype][0]),
                    getattr(gguf.LlamaFileType, OUTTYPES[outtype][1]))
    with atomic_output(path) as tmp:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
        _hyperparameters(writer, cfg, name or path.stem, ftype)
        _vocabulary(writer, AutoTokenizer.from_pretrained(tokenizer_dir), cfg.vocab_size)
        gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=cfg.vocab_size).add_to_gguf(writer, quiet=True)
        out: dict[str, Any] = {"tensors": _tensors(writer, model, qtype)}
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if check:
            out.update(compare_logits(model, tokenizer_dir, tmp, outtype))
            _refuse_a_failed_check(out, outtype, path)
    return out


def _refuse_a_failed_check(c: dict, outtype: str, path: Path) -> None:
    tolerance = OUTTYPES[outtype][2]
    wrong = []
    if c["tensors_differ"]:
        wrong.append(f"{len(c['tensors_differ'])} tensors are not the model's in {outtype}, e.g. "
                     f"{', '.join(c['tensors_differ'][:3])}")
    if c["layout_differs"]:
        wrong.append(f"its config gives another {', '.join(c['layout_differs'])}")
    if not c["max_diff"] <= tolerance * c["max_logit"]:  # a NaN fails too
        wrong.append(f"max |logit difference| {c['max_diff']:.4f} against logits up to {c['max_logit']:.2f} "
                     f"(at most {tolerance:.0%} of them for {outtype})")
    if not c["same_template"]:
        wrong.append("its chat template is lost")
    if wrong:
        raise CheckpointError(f"GGUF export: the file read back differs from the model ({'; '.join(wrong)}); "
                              f"{path} not written. The exporter gets this model's layout wrong: report it to "
                              "hf_cgpu with the model's config.json")


def _hyperparameters(writer, cfg, name: str, ftype) -> None:
    import gguf

    head_dim = _head_dim(cfg)
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads or cfg.num_attention_heads)
    writer.add_key_length(head_dim)  # llama.cpp's default, hidden/heads, is wrong where head_dim is set apart
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _vocabulary(writer, tokenizer, vocab_size: int) -> None:
    """Tokens in id order with llama.cpp's types (added special = control, other added = user-defined, ids the
    tokenizer lacks below the model's vocab_size = unused ``[PADi]``), as its convert_hf_to_gguf does for BPE."""
    import gguf

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer))
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_token_list(tokens)
    writer.add_token_types(types)


def pre_tokenizer_name(tokenizer) -> str:
    """llama.cpp's name for how ``tokenizer`` splits text before BPE; a tokenizer that is no byte-level BPE, or
    splits otherwise, is refused in one line."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str()) if getattr(tokenizer, "is_fast", False) else {}
    if (spec.get("model") or {}).get("type") != "BPE":
        raise SettingsError(f"GGUF export writes byte-level BPE tokenizers (SmolLM2, Llama 3, GPT-2 style); this one "
                            f"is {(spec.get('model') or {}).get('type') or type(tokenizer).__name__}")
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if spec["model"].get("byte_fallback") or any(s.get("type") == "Metaspace" for s in steps):
        raise SettingsError("GGUF export writes byte-level BPE tokenizers (SmolLM2, Llama 3, GPT-2 style); this one "
                            "is a SentencePiece-style BPE (Llama 2, TinyLlama)")
    for name, want in PRE_TOKENIZERS.items():
        if len(steps) == len(want) and all(all(s.get(k) == v for k, v in w.items()) for s, w in zip(steps, want)):
            return name
    if [s.get("type") for s in steps] == ["Split", "ByteLevel"]:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
        )

        if steps[0].get("pattern", {}).get("Regex") == GGUF_PRE_TOKENIZER_SPLITS.get("llama-bpe"):
            return "llama-bpe"
    raise SettingsError(f"GGUF export: the pre-tokenizer {json.dumps(pre)[:120]} has no llama.cpp name here "
                        f"(known: {', '.join(PRE_TOKENIZERS)}, llama-bpe)")


def _tensors(writer, model, qtype) -> int:
    import gguf

    cfg = model.config
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    n = 0
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp reads a missing output.weight as tied to token_embd
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise SettingsError(f"GGUF export: no llama.cpp name for the tensor {hf_name}")
        data = tensor.detach().float().cpu()
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _rotary_rows(data, heads)
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _rotary_rows(data, kv_heads)
        kind, stored = _stored(data.numpy(), qtype)
        writer.add_tensor(name, stored, raw_dtype=kind)
        n += 1
    return n


def _stored(data, qtype):
    """(the GGMLQuantizationType, the bytes) of float32 array ``data`` in a file whose matrices are ``qtype``:
    1-D tensors in f32, q8_0 rows that are no whole 32-blocks in f16 (as llama.cpp does)."""
    import gguf

    kind = qtype if data.ndim > 1 else gguf.GGMLQuantizationType.F32
    if kind == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
        kind = gguf.GGMLQuantizationType.F16
    return kind, gguf.quants.quantize(data, kind)


def _as_stored(tensor: torch.Tensor, qtype) -> torch.Tensor:
    """``tensor`` rounded as the file stores it, read back to float32: what a faithful reader loads."""
    import gguf

    kind, stored = _stored(tensor.detach().float().cpu().numpy(), qtype)
    return torch.from_numpy(gguf.quants.dequantize(stored, kind).reshape(tensor.shape))


LAYOUT = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "vocab_size", "tie_word_embeddings", "rms_norm_eps", "rope_theta", "hidden_act")
"""The config entries a llama computes with, compared between the model and the file read back."""


def _layout(cfg) -> dict:
    import numpy as np

    rope = getattr(cfg, "rope_parameters", None) or {}
    values = {k: getattr(cfg, k, None) for k in LAYOUT}
    values.update(head_dim=_head_dim(cfg), num_key_value_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
                  rope_theta=rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    return {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in values.items()}  # as the file keeps them


def _rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of a q/k projection (its weight, or its bias) in llama.cpp's rotary order (pairs interleaved, not
    halves), as its converter permutes them and transformers' GGUF loader undoes."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def compare_logits(model, tokenizer_dir: Path, path: Path, outtype: str = "") -> dict[str, Any]:
    """The GGUF file loaded back by transformers against ``model`` and the tokenizer of ``tokenizer_dir``, on one user
    turn in the chat template (plain text without one): ``max_diff`` (max |logit difference|), ``max_logit``,
    ``load_s`` (seconds to load the model), ``same_tokens`` (the prompt encodes to the same ids) and
    ``same_template``; with ``outtype`` (what the file was written as) also ``layout_differs`` (config entries of
    ``LAYOUT`` the file gives otherwise) and ``tensors_differ`` (tensors absent, extra, or not bit for bit the model's
    rounded to ``outtype``). Loaded from a folder holding only the file: beside config.json or tokenizer files,
    transformers would read those instead of the file's metadata. The biases the file holds are loaded, as llama.cpp
    loads them where they are present (transformers' GGUF config has no flag for them)."""
    import tempfile

    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "Write one sentence about rivers, then name three of them."
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    names = [t.name for t in gguf.GGUFReader(path).tensors]
    biases = {"attention_bias": any(n.endswith(".attn_q.bias") for n in names),
              "mlp_bias": any(n.endswith(".ffn_up.bias") for n in names)}
    with tempfile.TemporaryDirectory() as alone:
        (Path(alone) / "model.gguf").symlink_to(path.resolve())
        start = time.perf_counter()
        loaded = AutoModelForCausalLM.from_pretrained(alone, gguf_file="model.gguf", dtype=torch.float32,
                                                      **biases).eval()
        seconds = time.perf_counter() - start
        back = AutoTokenizer.from_pretrained(alone, gguf_file="model.gguf")
    with torch.no_grad():
        want, got = model.eval()(ids).logits, loaded(ids).logits
    out = {"max_diff": float((want - got).abs().max()), "max_logit": float(want.abs().max()), "load_s": seconds,
           "same_tokens": back(text, add_special_tokens=False).input_ids == ids[0].tolist(),
           "same_template": getattr(back, "chat_template", None) == getattr(tok, "chat_template", None)}
    if outtype:
        qtype = getattr(gguf.GGMLQuantizationType, OUTTYPES[outtype][0])
        mine, theirs = _layout(model.config), _layout(loaded.config)
        out["layout_differs"] = [k for k in LAYOUT if mine[k] != theirs[k]]
        kept, read = model.state_dict(), loaded.state_dict()
        out["tensors_differ"] = sorted(set(kept) ^ set(read)) + [
            name for name, t in kept.items() if name in read and not torch.equal(read[name], _as_stored(t, qtype))]
    return out


def seal_export(path: Path) -> None:
    """Record the written (and checked) ``path`` in its folder's manifest (kind gguf), entries of files since deleted
    dropped: ``hf-cgpu push DIR --include_gguf`` uploads exactly what was exported, verified."""
    folder = path.parent
    try:
        manifest = read_manifest(folder)
    except IntegrityError:  # none yet, or unreadable: this export starts it again
        manifest = Manifest("gguf", {})
    manifest.files = {rel: e for rel, e in manifest.files.items() if rel != path.name and (folder / rel).is_file()}
    manifest.files[path.name] = FileEntry(path.stat().st_size, sha256_file(path))
    write_manifest(folder, manifest)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser((ExportSettings,), prog="hf-cgpu export", description=about(
        "Write a fine-tuned run (its adapter merged into its base) or a llama-family model folder as one GGUF file "
        "for llama.cpp and Ollama, with its tokenizer and chat template.", "hf-cgpu export runs/smol-lora --gguf"))
    parser.add_argument("model_dir", help="a fine-tuning run's output_dir (or best/, merged/) or a model folder")
    parser.usage = "%(prog)s MODEL_DIR --gguf [--outtype bf16|f16|q8_0] [--SETTING VALUE ...]"
    ns = vars(parser.parse_args(argv))
    folder = Path(ns.pop("model_dir")).expanduser()
    s = ExportSettings(**{k: v for k, v in ns.items() if v is not None})
    if not s.gguf:
        raise SettingsError("hf-cgpu export writes GGUF only: add --gguf")
    if not folder.is_dir():
        raise MissingPathError(f"{folder} is no folder; pass a fine-tuning run's output_dir or a model folder")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise SettingsError("GGUF export needs the gguf package: pip install gguf") from None
    model, tokenizer_dir = load_for_export(folder, s.trust_remote_code, s.verify)
    name = folder.resolve().name
    path = Path(s.output).expanduser() if s.output else folder / GGUF_DIR / f"{name}-{s.outtype}.gguf"
    c = write_gguf(model, tokenizer_dir, path, s.outtype, name, check=s.check)
    if path.parent.resolve() == (folder / GGUF_DIR).resolve():
        seal_export(path)
    print(f"wrote {path}: {c['tensors']} tensors, {s.outtype}, {path.stat().st_size / 2**20:.1f} MiB")
    if s.check:
        print(f"check: transformers loads it back in {c['load_s']:.1f} s; every tensor as written; max |logit "
              f"difference| {c['max_diff']:.4f} (logits up to {c['max_logit']:.1f}) against the merged model; "
              f"tokenizer {'round-trips' if c['same_tokens'] else 'encodes the prompt differently'}, chat template "
              "kept")
        if not c["same_tokens"]:
            print("note: transformers reads some pre-tokenizers back as GPT-2's (SmolLM2's digit by digit split, for "
                  "one); llama.cpp splits text with the one the file names")
    return 0
