"""The card a run is priced on: its memory, its bf16 matmul rate, its memory bandwidth and the cost of a kernel launch.

Two sources, in this order: ``hf-cgpu bench`` run on this machine (what the card sustains, measured: the matmul rate at
several shapes, copy bandwidth, launch latency), or a card named with ``--card`` (``CARDS``: public figures). A public
figure is a datasheet upper bound; the time ledger multiplies it by ``SUSTAINED_MATMUL`` and ``SUSTAINED_BANDWIDTH``,
the share of the datasheet the lent H100 sustains in ``hf-cgpu bench``.

Dense bf16 tensor rate with fp32 accumulation (what PyTorch's bf16 matmuls use): GeForce Ampere, Ada and Blackwell
cards do 512 FLOP per SM per clock at that precision (half their fp16-accumulate rate; NVIDIA's architecture
whitepapers list both), so the rate is SMs x boost clock x 512. The datacenter rows are their datasheets' dense
figures.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import SettingsError

GEFORCE_FLOPS_PER_SM_CLOCK = 512
"""Dense bf16 FLOP per SM per clock with fp32 accumulation on GeForce Ampere / Ada / Blackwell tensor cores."""
SUSTAINED_MATMUL = 0.80
"""Share of the datasheet dense bf16 rate a large square matmul sustains (``hf-cgpu bench`` on the lent H100: 793 of
989 TFLOP/s)."""
SUSTAINED_BANDWIDTH = 0.89
"""Share of the datasheet bandwidth a device-to-device copy sustains (``hf-cgpu bench`` on the lent H100: 2,994 of
3,350 GB/s)."""
REFERENCE_SMS = 132
"""SMs of the card ``SMALL_MATMUL`` was measured on (H100 SXM)."""
HOST_LAUNCH_US = 9.0
"""Host time per eager PyTorch op (Python dispatch + CUDA launch) where no bench measured it: a property of the CPU
and the software more than of the card; ``hf-cgpu bench`` measures it."""
GRAPH_LAUNCH_US = 2.0
"""Device time per kernel replayed from a CUDA graph, where no bench measured it."""


@dataclass(frozen=True)
class Card:
    """What the time and memory ledgers need of one GPU."""

    name: str
    memory_gib: float
    matmul_tflops: float
    """Sustained dense bf16 TFLOP/s of a large matmul (the MFU denominator)."""
    bandwidth_gbs: float
    """Sustained read + write GB/s (10^9) of device memory."""
    launch_us: float = HOST_LAUNCH_US
    """Host microseconds per eager op."""
    graph_launch_us: float = GRAPH_LAUNCH_US
    """Device microseconds per kernel inside a CUDA graph."""
    matmul_curve: tuple[tuple[int, float], ...] = ()
    """(square size, TFLOP/s) as measured; empty = a public figure scaled by ``SMALL_MATMUL``'s curve."""
    sms: int = REFERENCE_SMS
    """Streaming multiprocessors: a card with fewer fills them with a smaller matmul (``SMALL_MATMUL``)."""
    source: str = ""
    """Where the figures come from (a bench of this machine, or the public figures of a named card)."""
    aliases: tuple[str, ...] = field(default=(), compare=False)

    def matmul_rate(self, m: float, n: float, k: float) -> float:
        """FLOP/s of an (m x k) @ (k x n) bf16 matmul: the rate measured at the nearest square size of equal work
        (interpolated in log size), capped by what its bytes allow at the card's bandwidth (a skinny product)."""
        size = (m * n * k) ** (1 / 3)
        if self.matmul_curve:
            rate = _interpolate(self.matmul_curve, size) * 1e12
        else:  # the reference card's curve at the size that gives each of its SMs as much work
            share = _interpolate(SMALL_MATMUL, size * (REFERENCE_SMS / self.sms) ** (1 / 3))
            rate = min(1.0, share) * self.matmul_tflops * 1e12
        bytes_moved = 2.0 * (m * k + k * n + m * n)
        flops = 2.0 * m * n * k
        return min(rate, flops / bytes_moved * self.bandwidth_gbs * 1e9)


SMALL_MATMUL = ((256, 0.004), (512, 0.031), (1024, 0.254), (2048, 0.865), (4096, 1.0), (8192, 0.93))
"""Share of the large-matmul rate a square bf16 matmul of each size reaches on the reference card (``hf-cgpu bench``
on the lent H100: 3.1, 24.7, 201, 686, 793 and 739 TFLOP/s), for a card without a bench of its own."""


def _interpolate(curve: tuple[tuple[int, float], ...], size: float) -> float:
    import math

    pts = sorted(curve)
    if size <= pts[0][0]:
        return pts[0][1] * size / pts[0][0]  # below the smallest measured size: launch-bound, rate ~ work
    for (s0, r0), (s1, r1) in zip(pts, pts[1:]):
        if size <= s1:
            w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return r0 + w * (r1 - r0)
    return pts[-1][1]


def _geforce(name: str, memory_gib: float, sms: int, boost_ghz: float, bandwidth_gbs: float,
             aliases: tuple[str, ...] = ()) -> Card:
    tflops = sms * boost_ghz * GEFORCE_FLOPS_PER_SM_CLOCK / 1e3
    return Card(name, memory_gib, tflops * SUSTAINED_MATMUL, bandwidth_gbs * SUSTAINED_BANDWIDTH, sms=sms,
                source=f"public figures: {sms} SMs x {boost_ghz:g} GHz x 512 = {tflops:.1f} TFLOP/s dense bf16, "
                       f"{bandwidth_gbs:g} GB/s; x {SUSTAINED_MATMUL:g} / {SUSTAINED_BANDWIDTH:g} sustained",
                aliases=aliases)


def _datacenter(name: str, memory_gib: float, tflops: float, bandwidth_gbs: float, sms: int,
                aliases: tuple[str, ...] = ()) -> Card:
    return Card(name, memory_gib, tflops * SUSTAINED_MATMUL, bandwidth_gbs * SUSTAINED_BANDWIDTH, sms=sms,
                source=f"datasheet: {tflops:g} TFLOP/s dense bf16, {bandwidth_gbs:g} GB/s; x {SUSTAINED_MATMUL:g} / "
                       f"{SUSTAINED_BANDWIDTH:g} sustained", aliases=aliases)


CARDS: dict[str, Card] = {c.name: c for c in (
    _geforce("RTX 3060", 12, 28, 1.777, 360, ("3060",)),
    _geforce("RTX 3090", 24, 82, 1.695, 936, ("3090",)),
    _geforce("RTX 4060 Ti 16GB", 16, 34, 2.535, 288, ("4060ti", "4060 ti")),
    _geforce("RTX 4070", 12, 46, 2.475, 504, ("4070",)),
    _geforce("RTX 4070 Ti Super", 16, 66, 2.61, 672, ("4070tisuper", "4070 ti super")),
    _geforce("RTX 4080", 16, 76, 2.505, 716.8, ("4080",)),
    _geforce("RTX 4090", 24, 128, 2.52, 1008, ("4090",)),
    _geforce("RTX 5060 Ti 16GB", 16, 36, 2.572, 448, ("5060ti", "5060 ti")),
    _geforce("RTX 5070", 12, 48, 2.512, 672, ("5070",)),
    _geforce("RTX 5070 Ti", 16, 70, 2.452, 896, ("5070ti", "5070 ti")),
    _geforce("RTX 5080", 16, 84, 2.617, 960, ("5080",)),
    _geforce("RTX 5090", 32, 170, 2.407, 1792, ("5090",)),
    _datacenter("A100 80GB", 80, 312, 2039, 108, ("a100",)),
    _datacenter("H100 SXM", 80, 989, 3350, 132, ("h100",)),
    _datacenter("H200", 141, 989, 4800, 132, ("h200",)),
)}
"""Cards the ledger can price without a bench, by name."""
DEFAULT_CARD = "RTX 5070 Ti"
"""The card ``hf-cgpu budget`` prices where no bench of this machine exists and none is named: the 16 GB card
hf_cgpu is made for."""


CPU_MATMUL = ((32, 0.007), (64, 0.03), (128, 0.09), (256, 0.12), (1024, 0.14), (2048, 0.17))
"""(square size, TFLOP/s) of an fp32 matmul on two cores of a current x86 server (PyTorch's CPU BLAS): unlike a GPU's,
the rate is near its top from a few hundred rows, so a small model is not priced as launch-bound."""
CPU = Card("CPU", 0, CPU_MATMUL[-1][1], 5.0, launch_us=5.0, graph_launch_us=5.0, matmul_curve=CPU_MATMUL,
           source="an assumed two-core CPU: 0.17 TFLOP/s fp32 matmul, 5 GB/s", aliases=("cpu",))
"""A CPU run's card, roughly: a machine with more cores runs faster than it says (a run with --fit_schedule_to_time
then times its real steps)."""


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower().replace("nvidia", "").replace("geforce", ""))


def find_card(name: str) -> Card:
    """The card called ``name`` (case, spaces, 'NVIDIA GeForce' ignored), or one line listing the names."""
    wanted = _key(name)
    for card in (*CARDS.values(), CPU):
        if wanted in {_key(card.name), *map(_key, card.aliases)}:
            return card
    raise SettingsError(f"unknown card {name!r}: choose one of {', '.join(CARDS)}, or run `hf-cgpu bench` on the "
                        "machine with the card (the ledger then uses its measured figures)")


def card_of_device(device_name: str) -> Card | None:
    """The named card whose name is in a CUDA device name ('NVIDIA GeForce RTX 5070 Ti' -> RTX 5070 Ti; the longest
    match, so an RTX 5070 Ti is not an RTX 5070), or None."""
    key = _key(device_name)
    found = [(len(k), c) for c in CARDS.values() for k in {_key(c.name), *map(_key, c.aliases)} if k and k in key]
    return max(found, key=lambda kc: kc[0])[1] if found else None


def run_card(peak_tflops: float, device, emulate: str = "") -> Card:
    """The card a training run on ``device`` is priced on: the card it emulates (``emulate``: --emulate_card), else
    this GPU's stored ``hf-cgpu bench``, else its public figures where it is a named card, else ``DEFAULT_CARD``'s; on
    the CPU, ``CPU``. ``peak_tflops`` (--peak_tflops) replaces the matmul rate."""
    if emulate:
        card = find_card(emulate)
    elif getattr(device, "type", str(device)) != "cuda":
        card = CPU
    else:
        import torch

        from ..bench import load_result

        name = torch.cuda.get_device_name(device)
        stored = load_result()
        if stored is not None and stored.device_name == name and stored.peak_bf16_tflops > 0:
            card = card_from_bench(stored)
        else:
            card = card_of_device(name) or CARDS[DEFAULT_CARD]
    return with_peak(card, peak_tflops)


def with_peak(card: Card, peak_tflops: float) -> Card:
    """``card`` with its matmul rate (and measured curve) scaled to ``peak_tflops`` where that is given (> 0)."""
    import dataclasses

    if peak_tflops <= 0:
        return card
    scale = peak_tflops / card.matmul_tflops
    return dataclasses.replace(card, matmul_tflops=peak_tflops,
                               matmul_curve=tuple((n, r * scale) for n, r in card.matmul_curve),
                               source=f"{card.source}; matmul rate from --peak_tflops")


def card_from_bench(result) -> Card:
    """The card as ``hf-cgpu bench`` measured it (``bench.BenchResult``)."""
    curve = tuple(sorted((int(s), float(r)) for s, r in result.matmul_tflops.items()))
    return Card(result.device_name, result.total_memory_bytes / 1024**3, result.peak_bf16_tflops,
                result.copy_bandwidth_gbs, launch_us=result.launch_us or HOST_LAUNCH_US,
                graph_launch_us=result.graph_launch_us or GRAPH_LAUNCH_US, matmul_curve=curve,
                source=f"hf-cgpu bench of this machine{', ' + result.measured_at if result.measured_at else ''}")


def resolve_card(name: str = "", use_bench: bool = True, bench_path=None) -> Card:
    """The card to price a run on: ``name`` (``--card``) when given, else this machine's ``hf-cgpu bench`` (one of
    another machine or an older format is refused in one line), else ``DEFAULT_CARD`` (its public figures)."""
    if name:
        return find_card(name)
    if use_bench:
        from ..bench import load_checked

        result = load_checked(bench_path)
        if result is not None and result.peak_bf16_tflops > 0:
            return card_from_bench(result)
    return CARDS[DEFAULT_CARD]
__all__ = ["CARDS", "CPU", "Card", "DEFAULT_CARD", "card_from_bench", "card_of_device", "find_card", "resolve_card",
           "run_card", "with_peak"]
