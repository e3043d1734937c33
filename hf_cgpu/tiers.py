"""Memory tiers: composable functions applied in one fixed order before the training loop.

Order (torchtitan style, one place that orders them, see `apply_tiers`):

    load_base_model        bf16 base (lora), nf4 base (qlora) or fp32 master weights (full, adamw8bit)
    1. apply_lora          adapters on a frozen base (lora, qlora); full/adamw8bit train every weight
    2. apply_recompute     activation checkpointing of every block, cache off
    3. apply_compile       per-block torch.compile(dynamic=False), in place
    4. accelerate prepare  done by the loop, which also owns the optimizer from `build_optimizer`

Adapters come first because checkpointing and compile must see the final modules (compiling before
LoRA injection would trace the bare base layers); checkpointing comes before compile so the compiled
region contains the checkpoint, as torchtitan does.

Where stock peft LoRA/QLoRA memory goes (Pythia-1.4B shape: 24 x 2048, vocab 50304, r=16 on the four
projections, micro-batch 4, seq 1024; docs/gpu.md measured stock at 12.4 GiB for LoRA, 13.2 for QLoRA):

- Weights. bf16 base: 1.41e9 x 2 B = 2.6 GiB. `prepare_model_for_kbit_training` casts every non-4-bit
  weight to fp32: embed_in and the head (103M parameters each) grow from 0.38 GiB together to 0.77 GiB,
  and because the norms become fp32 their outputs are fp32; bnb's Linear4bit returns its output
  in its input's dtype, so the residual stream, the checkpointed layer inputs (0.75 instead of
  0.38 GiB) and the LoRA branches all run in fp32.
- Logits. `XForCausalLM.forward` builds all logits: 4 x 1024 x 50304 = 206M entries, 0.38 GiB in bf16,
  which `ForCausalLMLoss` copies to fp32 (0.77 GiB); cross-entropy saves its fp32 log-softmax
  (0.77 GiB), and backward holds fp32 grads of both (2 x 0.77 GiB) next to the bf16 logits grad. That is
  ~2.5 GiB at the loss: over six times the whole checkpointed activation stack (24 x 4 x 1024 x 2048 x 2 B).
- LoRA branch. peft casts each adapted layer's input to the adapter's fp32 dtype and saves it for
  the A-weight gradient (for dense_4h_to_h a 128 MiB tensor per layer); with dropout > 0 it also
  keeps the dropped copy. Harmless under checkpointing (one layer at a time), costly without it.
- Checkpointing that never engages. Transformers only checkpoints `if self.gradient_checkpointing and
  self.training`, and `from_pretrained` returns the model in eval mode: a script that never calls
  `model.train()` keeps every activation.

Peak live tensor bytes of one step, estimated by replaying it on the meta device with a dispatch-mode
tracker (flash attention emulated, Adam state included, no allocator overhead, no autocast):

    stock LoRA, checkpointing on                 5.9 GiB     stock QLoRA, checkpointing on   5.3 GiB
    stock LoRA, left in eval mode (ckpt off)    14.9 GiB     stock QLoRA, left in eval mode 18.1 GiB
    stock LoRA, no ckpt, dropout 0.05           20.1 GiB
    this tier, LoRA                              3.8 GiB     this tier, QLoRA                2.1 GiB

The measured 12.4/13.2 GiB, with QLoRA above LoRA, sit between the "on" and "off" rows and rank like
the "off" rows: the peer's checkpointing most likely did not (fully) engage. Either way both targets
(<= 8 GiB LoRA, <= 6 GiB QLoRA) need checkpointing that really runs, and the rest is removed here:

- No fp32 upcast of the base: the frozen base stays bf16 (LayerNorm under autocast computes in fp32
  internally anyway), nf4 linears compute in bf16; only the LoRA A/B matrices are fp32 (12.6M
  parameters: 50 MB, 0.2 GB with grads and Adam state).
- The full logits are never built: `causal_lm_loss_from_hidden` runs the backbone and
  `chunked_causal_lm_loss` computes cross-entropy on chunks of 1024 tokens, each chunk's logits inside
  a non-reentrant checkpoint, so forward and backward hold one 1024 x 50304 fp32 chunk (0.19 GiB, plus
  its softmax grad) instead of ~2.5 GiB.
- `apply_recompute` uses non-reentrant checkpointing (no reliance on inputs that require grad) and
  puts the model in training mode so it engages.
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from typing import TYPE_CHECKING, Any

from .errors import SettingsError

if TYPE_CHECKING:  # torch is imported where a function needs it: the names above stay cheap to import
    import torch
    from torch import nn

TIERS = ("full", "adamw8bit", "lora", "qlora")
"""Every memory tier, least saving first: the one list the settings, the ladder and the loop read."""
OPTIMIZERS = ("adamw", "muon")
"""``TrainSettings.optimizer``: AdamW everywhere, or Muon on the hidden matrices with AdamW on the rest (hf_cgpu.optim)."""
TRAIN_MODES = ("pretrain", "finetune")
ADAPTER_TIERS = ("lora", "qlora")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
"""torch.compile modes ``--compile_mode`` takes (``default`` is torch.compile's own)."""
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The modes that run the compiled code under CUDA graphs (on CUDA)."""

# LoRA targets per architecture: every linear of attention and MLP (QLoRA paper: all-linear matches
# full fine-tuning; attention-only does not). Names checked on transformers 5.24.
LORA_TARGET_MODULES: dict[str, list[str]] = {
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "cgpt": ["qkv", "proj", "fc", "fc_out"],
}


def default_target_modules(model_type: str | None) -> list[str] | str:
    """LoRA target module names for a `config.model_type`; "all-linear" (peft skips the head) otherwise."""
    targets = LORA_TARGET_MODULES.get(model_type or "")
    return list(targets) if targets is not None else "all-linear"


def validate_tier(tier: str, recompute: bool, train_mode: str) -> None:
    """Reject impossible combinations at setup with a one-line error that names the fix.

    `train_mode` is "pretrain" (random init) or "finetune" (start from pretrained weights). Adapters
    on a frozen random base learn nothing useful, so the adapter tiers are fine-tuning only.
    """
    if tier not in TIERS:
        raise SettingsError(f"unknown tier {tier!r}: choose one of {', '.join(TIERS)}")
    if train_mode not in TRAIN_MODES:
        raise SettingsError(f"unknown train_mode {train_mode!r}: choose one of {', '.join(TRAIN_MODES)}")
    if not isinstance(recompute, bool):
        raise SettingsError(f"recompute must be True or False, got {recompute!r}")
    if train_mode == "pretrain" and tier == "qlora":
        raise SettingsError(
            "qlora is a fine-tuning tier: it trains LoRA adapters on a frozen 4-bit base; "
            "use --tier full or --tier adamw8bit for pretraining"
        )
    if train_mode == "pretrain" and tier == "lora":
        raise SettingsError(
            "lora is a fine-tuning tier: it trains adapters on a frozen pretrained base, and a frozen random "
            "base learns nothing; use --tier full or --tier adamw8bit for pretraining"
        )


def _freeze(model: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(False)


def load_base_model(
    name_or_path: str,
    tier: str,
    dtype: torch.dtype | None = None,
    device_map: Any = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load a causal LM with the weights the tier needs; adapter tiers come back frozen.

    `dtype=None` picks the tier's default: bf16 for lora/qlora (a frozen base needs no fp32 copy)
    and fp32 for full/adamw8bit, which train every weight and need fp32 master weights under bf16
    autocast (pure-bf16 AdamW loses updates smaller than 2^-8 of the weight).
    qlora stores linears in nf4 (the bitsandbytes default is fp4, worse for normal weights), double
    quantizes the block scales (~0.4 bit/param saved) and computes in bf16.
    """
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if tier not in TIERS:
        raise SettingsError(f"unknown tier {tier!r}: choose one of {', '.join(TIERS)}")
    if dtype is None:
        dtype = torch.bfloat16 if tier in ADAPTER_TIERS else torch.float32
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if tier == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
        )
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if tier in ADAPTER_TIERS:
        _freeze(model)
    return model


def _is_4bit(model: nn.Module) -> bool:
    if getattr(model, "is_loaded_in_4bit", False):
        return True
    return any(type(m).__name__ == "Linear4bit" for m in model.modules())


@contextlib.contextmanager
def peft_quiet():
    """Around peft's model wrapping: without the FutureWarning it triggers on transformers 5.23+ (it reads the
    deprecated ``is_gradient_checkpointing``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def apply_lora(
    model: nn.Module,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: list[str] | str | None = None,
) -> nn.Module:
    """Wrap `model` in a peft LoRA model: frozen base in its own dtype, fp32 trainable adapters.

    Deliberately not `prepare_model_for_kbit_training`: that upcasts every non-4-bit weight to fp32
    (embeddings, head, norms), which doubles those weights and turns the residual stream fp32 (see
    the module docstring). Input grads for checkpointing are enabled by `apply_recompute`.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if target_modules is None:
        target_modules = default_target_modules(model_type)
    _freeze(model)
    lora_config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
        bias="none",
        fan_in_fan_out=model_type == "gpt2",  # GPT-2's Conv1D stores weights transposed
        task_type="CAUSAL_LM" if isinstance(model, PreTrainedModel) else None,
    )
    if isinstance(target_modules, (list, tuple, set)):
        names = [n for n, _ in model.named_modules() if n]  # peft's list rule: a name, or a dotted suffix of one
        missing = sorted(k for k in set(target_modules) if not any(n == k or n.endswith("." + k) for n in names))
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if n and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")})
            raise SettingsError(f"--lora_target_modules: {', '.join(missing)} is no module of this "
                                f"{type(model).__name__}; its linear layers are {', '.join(linear)}")
    with peft_quiet():
        peft_model = get_peft_model(model, lora_config, autocast_adapter_dtype=True)
    for p in peft_model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # fp32 adapters: their updates are tiny relative to bf16 steps
    return peft_model


RECOMPUTE_POLICIES = ("full", "selective")
"""How much of each checkpointed block the backward recomputes: ``full`` everything (one more forward, the least
memory), ``selective`` only what is cheap (norms, activations, rotary, casts, the low-rank LoRA up-projections):
the outputs of the block's matmuls and of attention are kept."""


def _attention_ops() -> set:
    import torch

    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward")
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def selective_recompute_policy(ctx, op, *args, **kwargs):
    """Selective activation checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): keep the
    outputs of attention and of every matmul but a low-rank up-projection (a LoRA B: inner dimension at most an eighth
    of the output's, where an MLP's up-projection is 4x at most; its input is the tiny A output), recompute the rest.

    For a LoRA step the backward needs no input of a frozen matmul (dX = dY W), so a full recompute is one more
    forward on top of a backward of about one forward: +50% by FLOPs. Kept matmul outputs make the replay skip every
    large matmul and attention, so the backward pays only the memory-bound ops again."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    if op in _ATTENTION:
        return CheckpointPolicy.MUST_SAVE
    if op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        a, b = (args[1], args[2]) if op is aten.addmm.default else (args[0], args[1])
        inner, out = a.shape[-1], b.shape[-1]
        return CheckpointPolicy.PREFER_RECOMPUTE if 8 * inner <= out else CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_ATTENTION: set = set()


def validate_recompute_policy(policy: str) -> None:
    """One-line error for a recompute policy that is not one of ``RECOMPUTE_POLICIES`` (the settings, the ledger's
    setup and ``apply_recompute`` all check through here)."""
    if policy not in RECOMPUTE_POLICIES:
        raise SettingsError(f"unknown recompute policy {policy!r}: choose one of {', '.join(RECOMPUTE_POLICIES)} "
                            "(--recompute_policy)")


def _checkpoint_kwargs(policy: str) -> dict[str, Any]:
    validate_recompute_policy(policy)
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        _ATTENTION.update(_attention_ops())
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_recompute_policy)
    return kwargs


def apply_recompute(model: nn.Module, policy: str = "full") -> nn.Module:
    """Checkpoint every block (non-reentrant) through transformers' own mechanism; cache off.

    ``policy`` (``RECOMPUTE_POLICIES``): ``full`` recomputes each block once in the backward, ``selective`` keeps the
    matmul and attention outputs and recomputes the rest (``selective_recompute_policy``).
    Non-reentrant checkpointing needs no input that requires grad and supports autocast state and
    keyword arguments; transformers still enables input grads on the embeddings, which costs one b x s x d
    tensor and keeps reentrant-style custom layers working. Transformers only checkpoints in
    training mode and `from_pretrained` returns eval mode, so the model is put in training mode here:
    otherwise checkpointing is silently a no-op.
    """
    kwargs = _checkpoint_kwargs(policy)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        if not getattr(model, "supports_gradient_checkpointing", True):
            raise SettingsError(f"{type(model).__name__} does not support activation checkpointing: use recompute=False")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise SettingsError(f"{type(model).__name__} has no checkpointing hook: use recompute=False")
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    model.train()
    return model


def _transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks: transformers' `GradientCheckpointingLayer`s, else the largest ModuleList."""
    from torch import nn

    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - older transformers
        GradientCheckpointingLayer = ()  # type: ignore[assignment]
    blocks = [m for m in model.modules() if GradientCheckpointingLayer and isinstance(m, GradientCheckpointingLayer)]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    return list(max(lists, key=len)) if lists else []


def apply_compile(model: nn.Module, enabled: bool, mode: str | None = None, backend: str = "inductor") -> nn.Module:
    """`torch.compile(dynamic=False)` in place (`Module.compile`): parameter names keep no `_orig_mod.` prefix.

    A plain model is compiled whole, so the head and the loss fuse with the blocks: on an H200 the 124M GPT ran
    482k tok/s compiled whole against 339k with only its blocks compiled (benchmarks/RESULTS.md). An adapter
    (peft) model compiles each transformer block instead: peft's wrappers and `causal_lm_loss_from_hidden`,
    which calls the backbone directly, then still run compiled code. Identical blocks share one graph: the frozen
    embedding's output is made to require grad (``enable_input_require_grads``), else the first block's input
    differs from the others' in ``requires_grad`` and dynamo compiles that block a second time (a recompile in the
    first step; the price is the first block's input gradient, which nothing uses).
    `dynamic=False` because a second shape would compile a dynamic graph (docs/gpu.md). `backend` is inductor but
    for tests ("eager" and "aot_eager" trace with dynamo's guards, so recompiles are the same, without codegen).
    """
    if not enabled:
        return model
    blocks = _transformer_blocks(model) if hasattr(model, "peft_config") else []
    if blocks and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    how = compile_options(model, mode, backend)
    for block in blocks:
        _checkpoint_inside(block)
    for block in blocks or [model]:
        block.compile(dynamic=False, backend=backend, **how)
    return model


def _checkpointed_forward(self, *args, **kwargs):
    import torch

    forward = type(self).forward  # the class's function, bound by partial: dynamo 2.11 breaks the graph on __get__
    if self.training and torch.is_grad_enabled():
        return self._hf_cgpu_checkpoint(functools.partial(forward, self, **kwargs), *args)
    return forward(self, *args, **kwargs)


def _checkpoint_inside(block: nn.Module) -> None:
    """Move a checkpointed block's checkpoint from transformers' wrapper into the block's own ``forward``, i.e. into
    the region ``Module.compile`` compiles. Transformers before 5.23 checkpoint a layer in ``__call__``, outside
    the compiled ``_call_impl``: the backward then replays the compiled forward eagerly through autograd and
    runs its backward as a second graph, and a selective policy never reaches the traced ops (on an H200, 1.4B
    LoRA, transformers 5.17: full recompute +111% wall time for +36% device time, selective +85% with full's
    matmuls; benchmarks/RESULTS.md). Inside, dynamo traces the checkpoint into the block's graph, so the
    backward graph contains the recompute and the policy decides what is saved, as transformers >= 5.23 (which
    checkpoints ``forward``) already does. Same checkpoint function, same arguments; no-op when not checkpointed."""
    func = getattr(block, "_gradient_checkpointing_func", None)
    if not getattr(block, "gradient_checkpointing", False) or func is None:
        return
    block.gradient_checkpointing = False  # transformers' wrapper (either version) now calls the block as is
    block._hf_cgpu_checkpoint = func
    block.forward = types.MethodType(_checkpointed_forward, block)


def compile_options(model: nn.Module, mode: str | None, backend: str = "inductor") -> dict:
    """torch.compile's ``mode`` / ``options`` for ``model``: a model whose convolution weights are channels_last keeps
    channels_last inside inductor (``force_layout_optimization``, with the mode's own options merged in, since
    torch.compile takes one or the other). Inductor's heuristic turns its layout optimization off for a whole graph
    when one convolution has at least twice as many input as output channels (a UNet decoder's concatenated skips);
    the flow UNet's backward then fed NCHW tensors to cuDNN, which copied 23 activation-sized tensors a step back to
    channels_last (profiled on an H200: 2.98 ms of the step's 13.9 ms of device time, benchmarks/RESULTS.md)."""
    import torch

    convs = [p for p in model.parameters() if p.dim() == 4]  # 1x1 kernels are both layouts at once
    channels_last = all(p.is_contiguous(memory_format=torch.channels_last) for p in convs) and any(
        not p.is_contiguous() for p in convs)
    if backend != "inductor" or not channels_last:
        return {"mode": mode}
    import torch._inductor

    return {"options": {**torch._inductor.list_mode_options(mode or "default"), "force_layout_optimization": True}}


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters, counting each shared tensor once.

    bitsandbytes `Params4bit` stores two 4-bit values per uint8 element, so its `numel()` is half the
    logical count; the logical shape is in `quant_state.shape`.
    """
    trainable = total = 0
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        quant_state = getattr(p, "quant_state", None)
        n = quant_state.shape.numel() if quant_state is not None else p.numel()
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def _trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    named = []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            named.append((name, p))
    return named


def validate_optimizer(optimizer: str, tier: str, eight_bit: bool = False) -> None:
    """One-line errors for an optimizer the run cannot use: unknown, or Muon on any tier but full (the settings, the
    ledger's setup and ``build_optimizer`` all check through here)."""
    if optimizer not in OPTIMIZERS:
        raise SettingsError(f"optimizer={optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if optimizer == "muon" and (tier != "full" or eight_bit):
        raise SettingsError(f"optimizer muon has no {tier if tier != 'full' else '8-bit'} form (it trains every "
                            "weight in fp32); use --tier full or --optimizer adamw")


def build_optimizer(
    model: nn.Module,
    tier: str,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    paged: bool = False,
    fused: bool | None = None,
    optim_8bit: bool | None = None,
    optimizer: str = "adamw",
    muon_lr: float = 0.02,
    muon_momentum: float = 0.95,
    muon_weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; weight decay only on >= 2-D weights.

    Norm gains, biases and other 1-D parameters get no decay (decaying a gain towards 0 fights the
    normalisation). `optim_8bit=None` means 8-bit for tier adamw8bit only; pass True to also run
    LoRA adapters on `bnb.optim.AdamW8bit`. bitsandbytes keeps 32-bit state for tensors under 4096
    elements. `paged` uses `PagedAdamW8bit`, whose state can spill to host memory on a spike.
    `fused=None` turns on the fused torch kernel when every parameter is on CUDA (the loop then skips a non-finite
    step on the device, `train.update`). Not on the CPU: its fused AdamW's OpenMP region hangs in a forked child.
    `optimizer="muon"` (tier full only): `hf_cgpu.optim.MuonWithAdamW`, Muon at `muon_lr` on the 2-D hidden
    matrices, this AdamW on the rest.
    """
    import torch

    if tier not in TIERS:
        raise SettingsError(f"unknown tier {tier!r}: choose one of {', '.join(TIERS)}")
    validate_optimizer(optimizer, tier, eight_bit=bool(optim_8bit or paged))
    use_8bit = tier == "adamw8bit" if optim_8bit is None else optim_8bit
    named = _trainable_parameters(model)
    if not named:
        kind = "an 8-bit optimizer" if use_8bit else "the optimizer"
        raise SettingsError(
            f"{kind} got no trainable parameters (all requires_grad=False): "
            "apply LoRA (apply_tiers/apply_lora) for adapter tiers or unfreeze the model for full/adamw8bit"
        )
    decay = [p for _, p in named if p.ndim >= 2]
    no_decay = [p for _, p in named if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if use_8bit:
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
        return cls(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if paged:
        raise SettingsError("paged=True needs an 8-bit optimizer: use tier adamw8bit or optim_8bit=True")
    if fused is None:
        fused = all(p.is_cuda for _, p in named)
    if optimizer == "muon":
        from .optim import MuonWithAdamW, muon_param_groups

        groups = muon_param_groups(model, named, lr, weight_decay, muon_lr, muon_momentum, muon_weight_decay)
        return MuonWithAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=muon_momentum,
                             fused=fused)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)


def apply_tiers(
    model: nn.Module,
    tier: str,
    recompute: bool,
    compile: bool,
    lora_r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    target_modules: list[str] | str | None = None,
    compile_mode: str | None = None,
    compile_backend: str = "inductor",
    recompute_policy: str = "full",
) -> nn.Module:
    """Apply the tiers in the one fixed order: adapters -> recompute -> compile (accelerate: the loop).

    The returned model is what the loop must use (it is a `PeftModel` for adapter tiers).
    """
    if tier not in TIERS:
        raise SettingsError(f"unknown tier {tier!r}: choose one of {', '.join(TIERS)}")
    if tier == "qlora" and not _is_4bit(model):
        raise SettingsError("tier qlora needs a 4-bit base: load it with load_base_model(name, tier='qlora')")
    if tier in ADAPTER_TIERS:
        model = apply_lora(model, r=lora_r, alpha=lora_alpha, dropout=lora_dropout, target_modules=target_modules)
    if recompute:
        if recompute_policy == "selective" and not compile:
            warnings.warn("selective recompute without compile runs a Python policy on every op: on an H200 it made a "
                          "1.4B LoRA step 2.5x slower than no recompute (full recompute: 1.67x); use compile=True or "
                          "recompute_policy='full'", stacklevel=2)
        model = apply_recompute(model, recompute_policy)
    model = apply_compile(model, compile, mode=compile_mode, backend=compile_backend)
    model.train()
    return model


# --- loss without full logits -------------------------------------------------------------------


def chunked_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    shift: bool = True,
    lm_head_bias: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy without materialising the (B, T, V) logits.

    hidden_states (B, T, d) are the final-norm outputs; labels (B, T) are the input ids when `shift`
    (token t predicts label t+1, as transformers' `ForCausalLMLoss`), already aligned otherwise.
    Tokens are processed in chunks of `chunk_size`; each chunk's logits are built in fp32 inside a
    non-reentrant checkpoint that saves only its inputs, so one (chunk, V) block is alive at a time
    in forward and again in backward. Same value and gradients as the full computation.
    `num_items_in_batch` divides the summed loss instead of the local token count (for gradient
    accumulation over micro-batches of uneven token counts).
    """
    import torch.nn.functional as F

    from .models.cgpt.modeling_cgpt import chunked_cross_entropy

    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # (B, T), last position ignored
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])  # (N, d)
    labels = labels.reshape(-1).to(hidden.device)  # (N,)
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"hidden_states has {hidden.shape[0]} tokens but labels has {labels.shape[0]}")
    return chunked_cross_entropy(hidden, lm_head_weight, labels, chunk_size, bias=lm_head_bias,
                                 ignore_index=ignore_index, denominator=num_items_in_batch)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model under `torch.compile`'s wrapper and peft's `PeftModel`."""
    model = getattr(model, "_orig_mod", model)
    if hasattr(model, "get_base_model"):  # peft: LoRA layers stay injected in the returned model
        model = model.get_base_model()
    return model


def _backbone(lm: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (everything before the head)."""
    if hasattr(lm, "get_decoder"):
        try:
            decoder = lm.get_decoder()
        except (NotImplementedError, AttributeError, ValueError):
            decoder = None
        if decoder is not None and decoder is not lm:
            return decoder
    base = getattr(lm, "base_model", None)
    if base is not None and base is not lm:
        return base
    raise ValueError(f"cannot find the backbone of {type(lm).__name__}: expose get_decoder() or base_model_prefix")


def causal_lm_loss_from_hidden(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    shift: bool = True,
    **backbone_kwargs: Any,
) -> torch.Tensor:
    """The model's causal LM loss via its backbone and `chunked_causal_lm_loss`: no full logits.

    `labels` are the input ids when `shift` (HF convention), targets already aligned with the positions otherwise.

    Works for transformers causal LMs, peft-wrapped or compiled in place. It calls the backbone
    directly, so it bypasses the autocast that `accelerator.prepare` patches onto `model.forward`:
    call it under `accelerator.autocast()`. Heads with LoRA adapters, logit soft-capping or logit
    scaling are rejected because the chunked loss would silently skip them.
    """
    lm = unwrap_model(model)
    config = getattr(lm, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, attr, None) not in (None, 1.0):
            raise NotImplementedError(f"{type(lm).__name__} uses {attr}: use the model's own labels= loss")
    head = lm.get_output_embeddings()
    if head is None or hasattr(head, "base_layer"):
        raise ValueError("the output head is missing or has LoRA adapters: use the model's own labels= loss")
    backbone = _backbone(lm)
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **backbone_kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # (B, T, d)
    return chunked_causal_lm_loss(
        hidden,
        head.weight,
        labels,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        shift=shift,
        lm_head_bias=getattr(head, "bias", None),
        num_items_in_batch=num_items_in_batch,
    )

