"""The settings of every task, one frozen dataclass each, a docstring under every field (that is the ``--help``).

They live apart from the tasks so that parsing a command line, ``--help`` and ``hf-cgpu budget`` import neither
torch nor transformers: the task modules (``causal_lm``, ``flow_images``, ...) re-export them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..budget.shape import ModelShape, RunShape
from ..errors import SettingsError
from ..flow.samplers import check_sampler, parse_interval, sampler_names
from ..models import cgpt
from ..models.cgpt.options_cgpt import CgptOptions
from ..options import ADAPTER_TIERS, ATTN_IMPLEMENTATIONS, DATA_ORDERS, TIME_SAMPLINGS, VERIFY_MODES, check_choice
from ..settings import FIXED


@dataclass(frozen=True)
class GPTSettings(CgptOptions):
    """Model shape and data of a from-scratch GPT run."""

    train_mode: ClassVar[str] = "pretrain"

    seq_len: int = 1024
    """Tokens per training sequence; also the model's n_positions."""
    vocab_size: int = 32000
    """Tokenizer vocabulary to train (ignored when --tokenizer is given: its size is used)."""
    data_order: str = field(default="shifted", metadata=FIXED)
    """How training windows are cut from the token stream: shifted (a new random offset and order every epoch),
    random (nanoGPT: uniform random starts) or fixed (the same blocks every epoch; memorises a small corpus)."""
    document_masking: bool = field(default=False, metadata=FIXED)
    """Attention within each document: the positions of every training and validation window restart after each EOS,
    so a token attends only to its own document and its position counts from the document's start (a T x T mask per
    row). EOS ends its document; its target, the next document's first token, stays scored, so loss and bits/char
    compare with a run without it. Recorded in config.json: hf-cgpu eval scores the same way, and the saved model
    applies it by itself wherever it is called without position_ids (a forward over a stream, generate)."""
    attn_implementation: str = "sdpa"
    """Attention kernel, through transformers' attention interface: sdpa, or flex_attention (its block mask skips
    the tiles between documents under --document_masking, where sdpa reads a dense T x T mask; compiled with the
    model on CUDA; it has no attention-weight dropout, so --dropout acts on the residual and MLP only). The same
    attention either way (that dropout aside), so a resume may change it; the saved model loads with sdpa."""
    dataset: str = "builtin"
    """Text source: 'builtin' (Python's pydoc topics), a directory/files of parquet/json/txt, or a Hub id."""
    text_column: str = "text"
    """Column holding the documents."""
    tokenizer: str = ""
    """Existing tokenizer directory to use; empty = train a byte-level BPE on the training split."""
    tokenizer_train_docs: int = 50000
    """Documents sampled to train the tokenizer (more = slower, slightly better compression)."""
    num_proc: int = 0
    """Processes for tokenisation (0 = automatic)."""
    cache_dir: str = ""
    """Where packed token files are cached (empty = ~/.cache/hf_cgpu/packed or $HF_CGPU_CACHE/packed); trained
    tokenizers go to its tokenizers/ folder (empty: ~/.cache/hf_cgpu/tokenizers or $HF_CGPU_CACHE/tokenizers)."""
    prompts: str = ""
    """'|'-separated prompts continued at the end of training (empty = taken from validation text)."""
    max_new_tokens: int = 60
    """Tokens generated per prompt at the end of training."""
    input_noise: float = field(default=0.0, metadata=FIXED)
    """Input token replacement: in training, each input token is replaced with this probability by a token drawn
    uniformly from the vocabulary, while the targets stay the true next tokens (0 = off; 0.05-0.1 for many epochs of
    a small corpus). Drawn from each micro-batch's seed (exact resume); the positions of --document_masking are those
    of the true text; validation and generation see the text as it is."""
    teacher: str = field(default="", metadata=FIXED)
    """Knowledge distillation from saved GPT runs of hf_cgpu (an output_dir or its best/), comma-separated for an
    ensemble (their probabilities averaged): the loss is (1 - distill_weight) x cross-entropy + distill_weight x T^2 x
    KL(teacher || student) at temperature T, the teachers' logits computed on the fly under no_grad (bf16 on CUDA) one
    loss chunk at a time. A teacher needs this run's tokenizer (train it on the same corpus, or pass its tokenizer
    with --tokenizer); its folder's manifest is checked as hf-cgpu verify does; empty = off."""
    distill_weight: float = field(default=0.5, metadata=FIXED)
    """Share of the distillation term in the loss (--teacher), in (0, 1]."""
    distill_anneal: float = field(default=0.0, metadata=FIXED)
    """Fraction of the schedule's steps (as --fit_schedule_to_time fixes them) over which --distill_weight falls
    linearly to 0, the loss the plain cross-entropy from there on and the teacher no longer run (its soft targets
    speed the early steps, and the student is not held to the teacher's level at the end); 0 = the weight held all
    run, in [0, 1]."""
    distill_temperature: float = field(default=1.0, metadata=FIXED)
    """Temperature T of the teachers' and the student's softmax in the distillation term (--teacher); the term is
    scaled by T^2 so that its gradients keep their size."""
    teacher_top_k: int = field(default=0, metadata=FIXED)
    """Distil from a cache of the teacher's K likeliest next tokens at every position of the training stream (e.g.
    32): the teacher runs once over the stream before the first step (outside --max_minutes; its seconds are
    teacher_cache_seconds in all_results.json), the cache is kept in output_dir/teacher_cache (neither sealed nor
    pushed; a resume reads it), and the KL is over those K tokens, the teacher's probabilities renormalised over
    them; no teacher runs in the step. One teacher; 0 = its logits on the fly every step."""
    mtp_heads: int = field(default=0, metadata=FIXED)
    """Multi-token prediction: this many extra heads, head k predicting token t + 1 + k from the final hidden state at
    position t (a residual d x d linear on an RMSNorm) through the model's own LM head, their mean cross-entropy added
    to the loss with --mtp_weight, annealed out by --mtp_anneal. A target in another document (after an EOS) or past
    the row's end is not scored. The heads train with the model and are held in every checkpoint, but the saved model
    is the plain one (0 = off; e.g. 2)."""
    mtp_weight: float = field(default=0.3, metadata=FIXED)
    """Weight of the multi-token heads' mean loss at step 0 (--mtp_heads), > 0."""
    mtp_anneal: float = field(default=0.5, metadata=FIXED)
    """Fraction of the schedule's steps (as --fit_schedule_to_time fixes them) over which --mtp_weight falls linearly
    to 0; the loss is the plain one from there on, in (0, 1]."""
    auto: bool = False
    """Choose the model shape, dropout, weight decay and schedule (warm-up, the cosine fitted to the minutes) from
    the training split's token count and --max_minutes by one rule (hf_cgpu/budget/auto.py), as preset values: a
    flag given on the command line keeps its value. Prints one line saying what it chose and why; the run's settings
    record the choice and a resume keeps it. --preset auto sets this."""
    given_flags: str = field(default="", metadata={"cli": False, "given_flags": True})
    """The flags given on the command line, comma-separated (set by the parser): --auto leaves them as given."""

    def check_with(self, train: Any) -> None:
        """Checks against the run's TrainSettings, before anything starts."""
        if self.auto and train.max_minutes <= 0:
            raise SettingsError("--auto (--preset auto) chooses the run for the minutes it has: add --max_minutes M")

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ValueError as err:  # the model's own check, as one line with exit code 2
            raise SettingsError(str(err)) from None
        if self.seq_len < 2:
            raise SettingsError("seq_len must be at least 2")
        check_choice("data_order", self.data_order, DATA_ORDERS)
        check_choice("attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        if not 0 <= self.input_noise < 1:
            raise SettingsError(f"--input_noise {self.input_noise}; use a probability in [0, 1), e.g. 0.05 (0 = off)")
        if not 0 < self.distill_weight <= 1 or self.distill_temperature <= 0:
            raise SettingsError(f"--distill_weight {self.distill_weight} / --distill_temperature "
                                f"{self.distill_temperature}; use a weight in (0, 1] and a temperature > 0, e.g. 0.5 "
                                "and 1")
        if not 0 <= self.distill_anneal <= 1 or (self.distill_anneal and not self.teachers):
            raise SettingsError(f"--distill_anneal {self.distill_anneal:g} anneals a --teacher's weight: use a fraction "
                                "of the schedule in (0, 1] with --teacher DIR, e.g. 0.5, or 0 (the weight held)")
        if self.teacher_top_k and len(self.teachers) != 1:
            raise SettingsError(f"--teacher_top_k {self.teacher_top_k} caches the predictions of one --teacher DIR, "
                                f"this run has {len(self.teachers)}: give one, or --teacher_top_k 0 (an ensemble's "
                                "logits on the fly)")
        if self.teacher_top_k < 0 or (self.teacher_top_k > self.vocab_size and not self.tokenizer):
            raise SettingsError(f"--teacher_top_k {self.teacher_top_k}; use 1 .. --vocab_size {self.vocab_size:,} "
                                "(e.g. 32), or 0 for the teacher's logits on the fly")
        if self.mtp_heads and self.teachers:
            raise SettingsError("--mtp_heads and --teacher do not combine (the distillation loss makes its own "
                                "forward): keep one, e.g. --mtp_heads 0")
        if self.mtp_heads < 0 or self.mtp_weight <= 0 or not 0 < self.mtp_anneal <= 1:
            raise SettingsError(f"--mtp_heads {self.mtp_heads} / --mtp_weight {self.mtp_weight:g} / --mtp_anneal "
                                f"{self.mtp_anneal:g}; use heads >= 0 (0 = off), a weight > 0 and a fraction of the "
                                "schedule in (0, 1], e.g. 2, 0.3 and 0.5")

    @property
    def teachers(self) -> list[str]:
        """The --teacher folders."""
        return [t.strip() for t in self.teacher.split(",") if t.strip()]

    def model_config_kwargs(self, vocab_size: int, eos_token_id: int) -> dict[str, Any]:
        """The ``CgptConfig`` arguments of this run: its architecture options, the tokenizer's vocabulary and end of
        text, the sequence as the position table. Training builds the config from them, the ledger reads them."""
        documents = {"document_masking": True} if self.document_masking else {}  # off: config.json as before
        return dict(self.options(), vocab_size=vocab_size, n_positions=self.seq_len, bos_token_id=eos_token_id,
                    eos_token_id=eos_token_id, **documents)

    def model_config(self, vocab_size: int, eos_token_id: int) -> cgpt.CgptConfig:
        """The ``CgptConfig`` of this run (imports transformers)."""
        return cgpt.CgptConfig(**self.model_config_kwargs(vocab_size, eos_token_id))

    def run_shape(self, name: str = "", vocab_size: int | None = None, stream_tokens: int = 0) -> RunShape:
        """What the ledger needs of this GPT: the config training builds, read as ``config.json`` would be (no
        transformers import, so ``hf-cgpu budget`` stays quick; ``vocab_size``: the tokenizer's; ``stream_tokens``:
        the training stream's, where a teacher cache is priced)."""
        kwargs = self.model_config_kwargs(vocab_size or self.vocab_size, eos_token_id=0)
        shape = ModelShape.from_config({"model_type": "cgpt", **kwargs}, name or "cgpt")
        return RunShape(shape, self.seq_len, self.loss_chunk_size, train_mode=self.train_mode,
                        packed=self.document_masking, **self.ledger_extras(shape, stream_tokens))

    def ledger_extras(self, shape: ModelShape, stream_tokens: int = 0) -> dict[str, Any]:
        """``RunShape``'s multi-token heads and distillation teachers of this run: each teacher's shape from its
        folder's config.json (the student's own shape where the folder is not there yet: a run being planned), and
        with --teacher_top_k the cache's K and positions (``stream_tokens``; 0: not known)."""
        teachers = []
        for folder in self.teachers:
            config = Path(folder).expanduser() / "config.json"
            teachers.append(ModelShape.from_config_file(config) if config.is_file() else
                            dataclasses.replace(shape, name=f"{folder}: not there yet, the student's shape assumed"))
        cached = {"teacher_top_k": self.teacher_top_k, "stream_tokens": stream_tokens,
                  "loss_in_forward": False} if self.teacher_top_k else {}  # its loss: the student's head called aside
        return {"extra_heads": self.mtp_heads, "extra_heads_share": self.mtp_anneal, "teachers": tuple(teachers),
                "teacher_share": self.distill_anneal or 1.0, **cached}


@dataclass(frozen=True)
class FlowSettings:
    """UNet shape, data and sampling of a flow-matching image run."""

    train_mode: ClassVar[str] = "pretrain"

    dataset: str = "uoft-cs/cifar10"
    """Images: a Hub id (online), a directory of parquet files (train.parquet/test.parquet) or an imagefolder."""
    image_column: str = "img"
    """Column holding the images."""
    label_column: str = "label"
    """Column holding class labels (used when class_conditional)."""
    limit: int = 0
    """Use only the first this many training images (0 = all); for smoke tests."""
    base_channels: int = 128
    """UNet base width: 128 -> 6.1M parameters, 160 -> 9.3M, 192 -> 13.3M."""
    class_conditional: bool = True
    """Condition on the class label (with a null class for classifier-free guidance)."""
    cond_drop_prob: float = field(default=0.1, metadata=FIXED)
    """Probability of replacing the label by the null class in training (CFG needs the unconditional field)."""
    time_sampling: str = field(default="logit_normal", metadata=FIXED)
    """Training time distribution: uniform or logit_normal (more signal mid-path)."""
    sample_every_epochs: float = 10.0
    """Write a sample grid (EMA weights) and evaluate every this many epochs (0 = every --eval_steps)."""
    sampler: str = field(default="heun", metadata={"choices": sampler_names})
    """Sampler of the sample grids and of the saved pipeline (hf_cgpu.flow.samplers), as ``hf-cgpu sample`` takes it."""
    sample_steps: int = 8
    """Sampler steps for the sample grids (the default of ``hf-cgpu sample``)."""
    guidance_scale: float = 2.5
    """Classifier-free guidance scale of the sample grids (1 = no guidance)."""
    guidance_interval: str = "full"
    """Guidance of the sample grids only where t (0 = noise, 1 = data) lies in LO:HI, e.g. 0.15:0.8; full = every
    step. Saved with sample_steps and guidance_scale as the pipeline's defaults."""

    def __post_init__(self) -> None:
        if self.time_sampling not in TIME_SAMPLINGS:
            raise SettingsError(f"time_sampling={self.time_sampling!r}; use uniform or logit_normal")
        if not 0 <= self.cond_drop_prob < 1:
            raise SettingsError("cond_drop_prob must be in [0, 1)")
        check_sampler(self.sampler, "--sampler")
        parse_interval(self.guidance_interval)
        if self.sample_steps < 1:
            raise SettingsError(f"--sample_steps {self.sample_steps}; use 1 or more (the sample grids' and the saved "
                                "pipeline's solver steps)")
        if self.guidance_scale <= 0:
            raise SettingsError(f"--guidance_scale {self.guidance_scale}; use 1 (no guidance) or more, e.g. 2.5")


@dataclass(frozen=True)
class FlowDistillSettings:
    """Teacher, data and objective of a few-step distillation run (``hf-cgpu train flow-distill``)."""

    train_mode: ClassVar[str] = "finetune"

    teacher: str = field(default="", metadata=FIXED)
    """The trained FlowMatchPipeline folder (``hf-cgpu train flow`` output_dir) to distill; the student starts from its
    weights."""
    dataset: str = "uoft-cs/cifar10"
    """Images the student's paths start from: the teacher's training set (a Hub id, a parquet folder or an
    imagefolder)."""
    image_column: str = "img"
    """Column holding the images."""
    label_column: str = "label"
    """Column holding class labels (used when the teacher is class-conditional)."""
    limit: int = 0
    """Use only the first this many training images (0 = all); for smoke tests."""
    guidance_scale: float = field(default=0.0, metadata=FIXED)
    """Guidance of the teacher, baked into the student (which samples with one call per step): classifier-free, or
    autoguidance where the teacher folder saved a guidance model (``hf-cgpu sample --save_pipeline``); 0 = the teacher
    folder's saved scale. The run records the scale it resolved: a resume must resolve the same."""
    guidance_interval: str = field(default="", metadata=FIXED)
    """The teacher's guidance only where t (0 = noise, 1 = data) lies in LO:HI; full = every step; empty = the teacher
    folder's saved interval. The run records the interval it resolved: a resume must resolve the same."""
    guidance_range: str = field(default="", metadata=FIXED)
    """Guidance as the student's input: each training example draws its own scale w uniformly in LO:HI (LO >= 1; 1 =
    unguided), the teacher's targets are guided at that w (in --guidance_interval), and the student is told w, so
    the saved folder samples at any w in the range with one network evaluation a step (guidance_scale picks it);
    empty = off: the teacher's one --guidance_scale is baked in."""
    sample_guidance: float = 0.0
    """With --guidance_range: the saved folder's default guidance scale (its grids and --judge figures too); 0 = the
    teacher's scale, within the range."""
    levels: int = field(default=7, metadata=FIXED)
    """Step sizes 1, 1/2, ..., 2^-levels are trained; the smallest is bootstrapped from two Euler steps of the
    teacher."""
    consistency_fraction: float = field(default=0.25, metadata=FIXED)
    """Share of each batch trained on self-consistency targets (d > 0); the rest match the guided teacher at d = 0."""
    time_sampling: str = field(default="logit_normal", metadata=FIXED)
    """Times of the d = 0 rows: uniform or logit_normal (the flow preset's training distribution)."""
    sample_steps: int = 2
    """Euler steps of the sample grids and the saved pipeline's default (1 or 2 network evaluations an image)."""
    sample_every_epochs: float = 10.0
    """Write a sample grid (EMA weights) and evaluate every this many epochs (0 = every --eval_steps)."""
    init_student: str = field(default="", metadata=FIXED)
    """A finished flow-distill output_dir of the same --teacher to start the student from (the adversarial stage's
    starting point: --preset cifar10-gan); empty = the teacher's weights with a zero step-size embedding."""
    distill_weight: float = field(default=1.0, metadata=FIXED)
    """Weight of the shortcut (regression to the teacher) term; 0 = the adversarial term alone."""
    adversarial_weight: float = field(default=0.0, metadata=FIXED)
    """Weight of a GAN term on the student's 1- and 2-step samples against REAL training images
    (``hf_cgpu.flow.adversarial``): small trainable heads on the frozen teacher encoder's features judge them, trained with their own
    optimizer inside each step and checkpointed with the run; 0 = none (no discriminator)."""
    disc_lr: float = field(default=2e-4, metadata=FIXED)
    """Learning rate of the discriminator heads (Adam, betas 0 and 0.99, constant)."""
    disc_width: int = field(default=64, metadata=FIXED)
    """Channels of each discriminator head."""
    disc_time: float = field(default=0.8, metadata=FIXED)
    """Time t at which the frozen teacher encoder sees real and generated images (x_t = t x + (1 - t) noise; 1 = the
    clean image): the noise keeps the discriminator from winning on details the student cannot fix."""
    adversarial_steps: str = field(default="1,2", metadata=FIXED)
    """Euler step counts of the generated images the discriminator judges, in turn by row (the student's 1- and
    2-evaluation samples)."""
    judge: str = ""
    """A classifier folder (``hf-cgpu train classifier``, the one ``hf-cgpu eval --classifier`` takes) with the
    teacher's classes: every evaluation also samples --judge_images images (classes in turn, the saved default steps)
    and reports the share of the rarest predicted class (rarest_class_share; 1/K is balanced), which the card states;
    empty = none."""
    judge_images: int = 1000
    """Images judged at each evaluation with --judge."""
    verify: str = field(default="auto", metadata={"choices": lambda: VERIFY_MODES})
    """What of the teacher folder's manifest.json is checked before it is read: auto (the sizes; the SHA-256 too up to
    512 MiB), sizes, full, or off (a folder edited by hand); see docs/outputs.md."""

    def __post_init__(self) -> None:
        check_choice("verify", self.verify, VERIFY_MODES)
        if self.time_sampling not in TIME_SAMPLINGS:
            raise SettingsError(f"time_sampling={self.time_sampling!r}; use uniform or logit_normal")
        if self.levels < 1 or not 0 < self.consistency_fraction < 1:
            raise SettingsError("--levels must be >= 1 and --consistency_fraction in (0, 1), e.g. 7 and 0.25")
        if self.distill_weight < 0 or self.adversarial_weight < 0 or self.distill_weight + self.adversarial_weight == 0:
            raise SettingsError("--distill_weight and --adversarial_weight take >= 0 and not both 0, e.g. 1 and 0.1")
        if self.disc_lr <= 0 or self.disc_width < 8 or self.disc_width % 8 or not 0 < self.disc_time <= 1:
            raise SettingsError("--disc_lr takes > 0, --disc_width a multiple of 8, --disc_time a value in (0, 1]")
        if self.judge_images < 1:
            raise SettingsError(f"--judge_images {self.judge_images}; use 1 or more, e.g. 1000")
        self.adversarial_step_counts  # noqa: B018 - validates adversarial_steps
        if self.guidance_scale < 0 or self.sample_steps < 1:
            raise SettingsError("--guidance_scale takes >= 1 (or 0: the teacher's) and --sample_steps >= 1")
        if self.guidance_interval:
            parse_interval(self.guidance_interval)
        if self.guidance_range and (self.adversarial_weight > 0 or self.init_student):
            raise SettingsError("--guidance_range trains a student from the teacher; the adversarial stage "
                                "(--adversarial_weight, --init_student) samples at one guidance: leave one out")
        lo_hi = self.guidance_scales
        if self.sample_guidance and not (lo_hi and lo_hi[0] <= self.sample_guidance <= lo_hi[1]):
            raise SettingsError(f"--sample_guidance {self.sample_guidance:g} needs a --guidance_range holding it, e.g. "
                                "--guidance_range 1:3; leave it out (0) for the teacher's scale")

    @property
    def guidance_scales(self) -> tuple[float, float] | None:
        """``guidance_range`` as (LO, HI), None when off."""
        if not self.guidance_range:
            return None
        try:
            lo, hi = (float(x) for x in self.guidance_range.split(":"))
        except ValueError:
            lo = hi = float("nan")
        if not 1 <= lo <= hi < float("inf"):
            raise SettingsError(f"--guidance_range {self.guidance_range!r}; write LO:HI with 1 <= LO <= HI (1 = "
                                "unguided), e.g. 1:3")
        return (lo, hi)

    @property
    def adversarial_step_counts(self) -> tuple[int, ...]:
        """``adversarial_steps`` as ints."""
        try:
            counts = tuple(int(n) for n in self.adversarial_steps.split(","))
        except ValueError:
            counts = ()
        if not counts or min(counts) < 1:
            raise SettingsError(f"--adversarial_steps {self.adversarial_steps!r}; give step counts >= 1, e.g. 1,2")
        return counts


@dataclass(frozen=True)
class FinetuneSettings:
    """Base model and data of a fine-tuning run."""

    train_mode: ClassVar[str] = "finetune"

    model: str = "EleutherAI/pythia-1.4b"
    """Base causal LM: a Hub id (needs network once), a local directory (our own GPT works too) or a .gguf file."""
    gguf_file: str = ""
    """GGUF file inside --model (a folder or Hub id); de-quantised once into the cache, then loaded per tier."""
    base_model_name: str = ""
    """Hub id of the base recorded in the card's base_model (e.g. HuggingFaceTB/SmolLM2-135M-Instruct for its GGUF);
    empty = --model."""
    dataset: str = "builtin"
    """Text or instruction data: a directory/files of parquet/json/txt, a Hub id, or 'builtin'."""
    data_format: str = field(default="auto", metadata=FIXED)
    """auto (instruction columns -> instruct, else text), instruct (messages, instruction/input/output or
    prompt/response rows in the base's chat template, loss on the responses only) or text (plain text, packed)."""
    text_column: str = "text"
    """Column with plain text (data_format text)."""
    skip_bad_rows: bool = False
    """Leave out instruction rows whose fields are not text (a null or missing output, a message without content),
    counted in one line per split; false: the first one is refused, naming its file, row and field."""
    seq_len: int = field(default=1024, metadata=FIXED)
    """Tokens per training sequence."""
    packing: bool = field(default=True, metadata=FIXED)
    """Instruction data: several whole examples per training row (best-fit decreasing, little padding), positions
    restarting at each example so attention and the loss stay within it; false: one example per row, padded to
    --seq_len. An example longer than a row is cut either way (counted). Validation rows are never packed. A check
    at start-up (a packed row against its examples alone) turns packing off, saying why, on a base whose positions
    do not restart (OPT, BLOOM); a --packing true given on the command line is refused there instead."""
    loss_chunk_size: int = 1024
    """Tokens per chunk of the fp32 loss (the full logits are never materialised)."""
    merge: bool = False
    """Also write the adapter merged into a copy of the base (output_dir/merged, with the tokenizer)."""
    merge_dtype: str = "bfloat16"
    """Weights of the merged copy: bfloat16 (half the size) or float32 (the adapter's outputs to float precision)."""
    trust_remote_code: bool = False
    """Allow the base model's own code from its repository."""
    num_proc: int = 0
    """Processes for tokenisation (0 = automatic)."""
    cache_dir: str = ""
    """Where packed token files are cached (empty = default cache)."""
    verify: str = field(default="auto", metadata={"choices": lambda: VERIFY_MODES})
    """What of a local --model folder's manifest.json (a run of hf_cgpu) is checked before it is read: auto (the
    sizes; the SHA-256 too up to 512 MiB), sizes, full, or off (a folder edited by hand); see docs/outputs.md."""
    given_flags: str = field(default="", metadata={"cli": False, "given_flags": True})
    """The flags given on the command line, comma-separated (set by the parser): a --packing true given there is
    refused on a base that packing does not suit, where the default falls back to one example per row."""

    def __post_init__(self) -> None:
        check_choice("verify", self.verify, VERIFY_MODES)
        if self.merge_dtype not in ("bfloat16", "float32", "float16"):
            raise SettingsError(f"merge_dtype={self.merge_dtype!r}; choose bfloat16, float16 or float32")
        if self.data_format not in ("auto", "instruct", "text"):
            raise SettingsError(f"data_format={self.data_format!r}; choose auto, instruct or text")


@dataclass(frozen=True)
class DPOSettings(FinetuneSettings):
    """Base model, SFT adapter, preference data and loss of a DPO run (``hf-cgpu train dpo``)."""

    dataset: str = ""
    """Preference rows: prompt, chosen and rejected, each a string or a list of {role, content} messages (TRL's
    formats), in JSON lines or parquet files (a folder, files, or a Hub id); a validation split is carved when there is
    none."""
    adapter: str = field(default="", metadata=FIXED)
    """The SFT adapter to continue: the output_dir of `hf-cgpu train lora` on --model. Training starts from it, and
    as it is it is the reference policy (its log-probabilities computed once, before the first step); the folder is
    only read. Empty: a new LoRA on --model, the base as the reference (needs --require_adapter false)."""
    require_adapter: bool = field(default=True, metadata=FIXED)
    """Refuse a run without --adapter: preference tuning continues a fine-tuned model, and a DPO run pointed at a bare
    base usually forgot its SFT adapter; false: train a new LoRA on the base."""
    beta: float = field(default=0.1, metadata=FIXED)
    """DPO's beta: how far the policy may move from the reference (higher: less); the implicit reward of an answer is
    beta x (its log-probability under the policy - under the reference)."""
    skip_bad_rows: bool = False
    """Leave out preference rows that are no pair (a missing or non-text field, the same answer twice, a prompt that
    fills a row before its answer), counted in one line per split; false: the first one is refused, naming its file,
    row and field."""
    seq_len: int = field(default=1024, metadata=FIXED)
    """Tokens of the prompt and one answer (TRL's max_length); a longer answer is cut (counted)."""
    packing: bool = field(default=True, metadata=FIXED)
    """Several whole pairs per training row of 2 x (seq_len + 1) tokens (chosen then rejected, positions restarting at
    each answer, so attention and the loss stay within it); false: two padded rows of seq_len + 1 tokens a pair.
    Held-out pairs are never packed. The start-up check of train lora turns packing off on a base whose positions do
    not restart; a --packing true given on the command line is refused there instead."""
    data_format: str = field(default="preference", metadata={"cli": False})
    """Preference rows (prompt, chosen, rejected)."""
    text_column: str = field(default="text", metadata={"cli": False})
    """Unused: preference rows have no text column."""
    num_proc: int = field(default=0, metadata={"cli": False})
    """Unused: preference rows are tokenized in the process."""
    cache_dir: str = field(default="", metadata={"cli": False})
    """Unused: preference rows are not cached."""

    def __post_init__(self) -> None:
        check_choice("verify", self.verify, VERIFY_MODES)
        if self.merge_dtype not in ("bfloat16", "float32", "float16"):
            raise SettingsError(f"merge_dtype={self.merge_dtype!r}; choose bfloat16, float16 or float32")
        if self.beta <= 0:
            raise SettingsError(f"--beta {self.beta}; use a positive value, e.g. 0.1")

    def check_with(self, train: Any) -> None:
        """An adapter tier, a dataset, and an SFT adapter where --require_adapter asks for one."""
        if train.tier not in ADAPTER_TIERS:
            raise SettingsError(f"--tier {train.tier}: DPO trains an adapter on a frozen base, whose reference "
                                "log-probabilities are computed once; use --tier lora or qlora")
        if not self.dataset:
            raise SettingsError("--dataset is empty: pass preference rows (prompt, chosen, rejected), e.g. "
                                "benchmarks/finetune/make_preferences.py's output")
        if not self.adapter and self.require_adapter:
            raise SettingsError(f"--adapter is empty and this preset (tier {train.tier}) continues an SFT adapter: "
                                "pass --adapter DIR (the output_dir of hf-cgpu train lora on --model), or "
                                "--require_adapter false to train a new LoRA on the bare base")


@dataclass(frozen=True)
class ClassifierSettings:
    """Data, shape and augmentation of a classifier run."""

    train_mode: ClassVar[str] = "pretrain"

    dataset: str = "uoft-cs/cifar10"
    """Images: a Hub id (online), a directory of parquet files (train.parquet/test.parquet) or an imagefolder."""
    image_column: str = "img"
    """Column holding the images."""
    label_column: str = "label"
    """Column holding the class labels."""
    limit: int = 0
    """Use only the first this many training images (0 = all); for smoke tests."""
    test_limit: int = 0
    """Evaluate on only the first this many test images (0 = the whole test split)."""
    widths: str = "64,128,256,512"
    """Channels of the four stages of the ResNet-9-style net (64,128,256,512 -> 6.57M parameters)."""
    label_smoothing: float = field(default=0.2, metadata=FIXED)
    """Label smoothing of the training cross-entropy (evaluation uses none)."""
    crop_padding: int = field(default=4, metadata=FIXED)
    """Random crop after reflect-padding by this many pixels (0 = no crop)."""
    flip: bool = field(default=True, metadata=FIXED)
    """Random horizontal flips."""

    def __post_init__(self) -> None:
        try:
            widths = self.width_list
        except ValueError:
            widths = []
        if len(widths) != 4:
            raise SettingsError(f"widths={self.widths!r}; give four comma-separated integers, e.g. 64,128,256,512")
        if not 0 <= self.label_smoothing < 1:
            raise SettingsError("label_smoothing must be in [0, 1)")

    @property
    def width_list(self) -> list[int]:
        return [int(w) for w in self.widths.split(",")]


@dataclass(frozen=True)
class Toy2DSettings:
    """Data, network and evaluation of the 2D toy (8 Gaussians on a circle)."""

    train_mode: ClassVar[str] = "pretrain"

    num_modes: int = field(default=8, metadata=FIXED)
    """Gaussians on the circle."""
    radius: float = field(default=2.0, metadata=FIXED)
    """Circle radius."""
    mode_std: float = field(default=0.08, metadata=FIXED)
    """Standard deviation of each Gaussian."""
    hidden: int = field(default=64, metadata=FIXED)
    """MLP width."""
    depth: int = field(default=3, metadata=FIXED)
    """Hidden layers of the MLP."""
    time_embed_dim: int = field(default=32, metadata=FIXED)
    """Sinusoidal features of t fed to the MLP; 0 feeds raw t like the seed."""
    time_sampling: str = field(default="uniform", metadata=FIXED)
    """'uniform' or 'logit_normal' (see FlowMatcher)."""
    logit_mean: float = field(default=0.0, metadata=FIXED)
    """Logit-normal mean (> 0 trains more near the data end)."""
    logit_std: float = field(default=1.0, metadata=FIXED)
    """Logit-normal spread."""
    num_samples: int = 2000
    """Samples drawn for each evaluation row."""
    nfe_budgets: str = "2,5,10,20,100"
    """Comma-separated network-evaluation budgets; Heun takes N = (budget + 1) // 2 steps, 2N - 1 <= budget calls."""
    hit_radius: float = 0.3
    """A sample counts as on a mode when this close to its centre."""
    guidance_model: str = ""
    """Also sample with autoguidance by this weaker model: a checkpoint folder (e.g. OUTPUT_DIR/checkpoints/step_N,
    an early one of this run, written before its end) or one of its .safetensors files; empty = no autoguided rows."""
    guidance_scale: float = 1.5
    """Autoguidance w of those rows, v_weak + w (v - v_weak) (two network evaluations a call)."""
    threads: int = 1
    """torch CPU threads. 1 on purpose: for matrices this small a second OpenMP thread gains little on an idle
    machine and, on a shared one, OpenMP's spin-waiting makes a step many times slower."""

    def __post_init__(self) -> None:
        if self.time_sampling not in TIME_SAMPLINGS:
            raise SettingsError(f"time_sampling={self.time_sampling!r}; use uniform or logit_normal")
        if self.logit_std <= 0:
            raise SettingsError(f"logit_std={self.logit_std} must be > 0")
        if self.guidance_scale < 1:
            raise SettingsError(f"guidance_scale={self.guidance_scale}; use a value >= 1 (1 = the model alone)")
        self.budgets  # noqa: B018 - validates nfe_budgets

    @property
    def budgets(self) -> tuple[int, ...]:
        """``nfe_budgets`` as ints."""
        try:
            budgets = tuple(int(b) for b in self.nfe_budgets.split(","))
        except ValueError:
            raise SettingsError(f"nfe_budgets={self.nfe_budgets!r}; write comma-separated integers like 2,5,10") from None
        if min(budgets) < 1:
            raise SettingsError(f"nfe_budgets={self.nfe_budgets!r}; every budget must be >= 1")
        return budgets


__all__ = ["ClassifierSettings", "DPOSettings", "FinetuneSettings", "FlowDistillSettings", "FlowSettings", "GPTSettings",
           "Toy2DSettings"]
