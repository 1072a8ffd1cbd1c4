"""Draw the lessons' conceptual diagrams as SVG files, package data in course/minifer_course/lessons/diagrams/.

One picture per lesson of the mechanism it teaches (the generation loop, prefill vs decode, the
KV cache growing, the roofline, the KV cache's bytes, sampling, a batched decode step, paged
blocks, static vs continuous batching, quantization, speculative decoding, the server's request
path, the tensor-parallel split). A lesson shows its diagram from a code cell,
``minifer_course.lessons.diagram("01_generation_loop")``, whose stored output is the SVG itself: it shows
on GitHub, nbviewer, in JupyterLab and on Colab (a saved copy included), where a relative image
link would break. Every text is checked to fit its box when set in DejaVu Sans, the widest of the
common fallbacks for Helvetica and Arial. They are drawn by this script rather than by hand so
that a change of style is one edit; ``tests/test_diagrams.py`` checks that the committed files are
what this script draws and that every lesson shows its diagram.

    python tools/draw_diagrams.py [--out course/minifer_course/lessons/diagrams]
"""

from __future__ import annotations

import argparse
import pathlib
from xml.sax.saxutils import escape

import torch

from minifer.quantization import quantize_int8
from minifer.sampling import apply_top_p

BLUE, ORANGE, GREEN, RED, GREY, PURPLE = "#4c78a8", "#f58518", "#54a24b", "#e45756", "#9d9d9d", "#b279a2"
LIGHT = {BLUE: "#dbe7f3", ORANGE: "#fde6cf", GREEN: "#dcefd8", RED: "#f9dcdc", GREY: "#eeeeee",
         PURPLE: "#efe0ea"}
INK = "#333333"


# Advance widths, in thousandths of an em, of DejaVu Sans (regular, bold) for the characters 32-126,
# read from the fonts' hmtx tables. DejaVu Sans is what "Helvetica, Arial, sans-serif" becomes on a
# machine without Arial (most Linux desktops, Binder), and it is wider than Arial, Helvetica and
# Liberation Sans: a text that fits in its box with these widths fits with those fonts too.
DEJAVU = [
    318, 401, 460, 838, 636, 950, 780, 275, 390, 390, 500, 838, 318, 361, 318, 337, 636, 636, 636,
    636, 636, 636, 636, 636, 636, 636, 337, 337, 838, 838, 838, 531, 1000, 684, 686, 698, 770,
    632, 575, 775, 752, 295, 295, 656, 557, 863, 748, 787, 603, 787, 695, 635, 611, 732, 684, 989,
    685, 611, 685, 390, 337, 390, 838, 500, 500, 613, 635, 550, 635, 615, 352, 635, 634, 278, 278,
    579, 278, 974, 634, 612, 635, 635, 411, 521, 392, 634, 592, 818, 592, 592, 525, 636, 337, 636,
    838,
]
DEJAVU_BOLD = [
    348, 456, 521, 838, 696, 1002, 872, 306, 457, 457, 523, 838, 380, 415, 380, 365, 696, 696,
    696, 696, 696, 696, 696, 696, 696, 696, 400, 400, 838, 838, 838, 580, 1000, 774, 762, 734,
    830, 683, 683, 821, 837, 372, 372, 775, 637, 995, 837, 850, 733, 850, 770, 720, 682, 812, 774,
    1103, 771, 724, 725, 457, 365, 457, 838, 500, 500, 675, 716, 593, 716, 678, 435, 716, 712,
    343, 343, 665, 343, 1042, 712, 687, 716, 716, 493, 595, 478, 712, 652, 924, 645, 652, 582,
    712, 365, 712, 838,
]
DEJAVU_OTHER = {"·": (318, 380), "×": (838, 838), "–": (500, 500), "—": (1000, 1000), "→": (838, 838), "−": (838, 838), "∝": (714, 712), "≈": (838, 838), "≤": (838, 838), "≥": (838, 838), "✓": (838, 838), "✗": (838, 838)}  # (regular, bold)


def text_width(s: str, size: float, bold: bool = False) -> float:
    """The width of `s` in pixels at font size `size`, set in DejaVu Sans (an unknown character
    counts as a full em)."""
    table = DEJAVU_BOLD if bold else DEJAVU
    units = sum(table[ord(ch) - 32] if 32 <= ord(ch) < 127 else DEJAVU_OTHER.get(ch, (1000, 1000))[bold]
                for ch in s)
    return units * size / 1000


class Canvas:
    """A few SVG primitives: boxes with centred text, arrows, text and lines."""

    def __init__(self, width: int, height: int, title: str) -> None:
        self.width, self.height, self.title = width, height, title
        self.parts: list[str] = []
        self.texts: list[tuple[str, float, float, float, float]] = []  # text, left, right, bounds

    def box(self, x: float, y: float, w: float, h: float, text: str = "", color: str = BLUE, *,
            size: int = 13, bold: bool = False, dashed: bool = False, fill: str | None = None) -> None:
        dash = ' stroke-dasharray="5,3"' if dashed else ""
        self.parts.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="6" '
                          f'fill="{fill or LIGHT.get(color, "#ffffff")}" stroke="{color}" '
                          f'stroke-width="1.5"{dash}/>')
        lines = text.split("\n") if text else []
        for i, line in enumerate(lines):
            ty = y + h / 2 + (i - (len(lines) - 1) / 2) * (size + 3) + size * 0.35
            self.text(x + w / 2, ty, line, size=size, bold=bold, within=(x + 3, x + w - 3))

    def cell(self, x: float, y: float, w: float, h: float, color: str, text: str = "", *,
             size: int = 11) -> None:
        """A small square (a token, a block, a matrix entry): filled with the strong colour."""
        self.parts.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{color}" '
                          f'stroke="#ffffff" stroke-width="1"/>')
        if text:
            self.text(x + w / 2, y + h / 2 + size * 0.35, text, size=size, color="#ffffff",
                      within=(x + 1, x + w - 1))

    def text(self, x: float, y: float, s: str, *, size: int = 13, anchor: str = "middle",
             bold: bool = False, color: str = INK, italic: bool = False,
             within: tuple[float, float] | None = None) -> None:
        """A line of text at (x, y); `within` is the span it must fit in (default: the canvas)."""
        width = text_width(s, size, bold)
        left = {"start": x, "middle": x - width / 2, "end": x - width}[anchor]
        lo, hi = within or (2, self.width - 2)
        self.texts.append((s, left, left + width, lo, hi))
        weight = ' font-weight="bold"' if bold else ""
        style = ' font-style="italic"' if italic else ""
        self.parts.append(f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" '
                          f'fill="{color}"{weight}{style}>{escape(s)}</text>')

    def line(self, x1: float, y1: float, x2: float, y2: float, *, color: str = INK,
             width: float = 1.5, dashed: bool = False) -> None:
        dash = ' stroke-dasharray="5,3"' if dashed else ""
        self.parts.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{color}" '
                          f'stroke-width="{width}"{dash}/>')

    def arrow(self, x1: float, y1: float, x2: float, y2: float, label: str = "", *,
              color: str = INK, dashed: bool = False, above: bool = True) -> None:
        dash = ' stroke-dasharray="5,3"' if dashed else ""
        self.parts.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{color}" '
                          f'stroke-width="1.5" marker-end="url(#head)"{dash}/>')
        if label:
            dy = -6 if above else 15
            self.text((x1 + x2) / 2, (y1 + y2) / 2 + dy, label, size=11, color=color)

    def path(self, d: str, *, color: str = INK, arrow: bool = True, dashed: bool = False) -> None:
        head = ' marker-end="url(#head)"' if arrow else ""
        dash = ' stroke-dasharray="5,3"' if dashed else ""
        self.parts.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.5"{head}{dash}/>')

    def overflowing(self) -> list[str]:
        """The texts that would not fit their box (or the canvas) if set in DejaVu Sans."""
        return [f"{s!r} spans {left:.0f}-{right:.0f}, room {lo:.0f}-{hi:.0f}"
                for s, left, right, lo, hi in self.texts if left < lo - 0.5 or right > hi + 0.5]

    def svg(self) -> str:
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}" font-family="Helvetica, Arial, Liberation Sans, DejaVu Sans, sans-serif">\n'
                f'<title>{escape(self.title)}</title>\n'
                '<defs><marker id="head" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
                f'fill="{INK}"/></marker></defs>\n'
                f'<rect width="{self.width}" height="{self.height}" fill="#ffffff"/>\n')
        return head + "\n".join(self.parts) + "\n</svg>\n"


def generation_loop() -> Canvas:
    c = Canvas(760, 250, "The generation loop: text in, one token per pass, text out")
    c.text(380, 24, "The generation loop (lesson 01)", size=15, bold=True)
    c.box(20, 60, 110, 50, '"To be, or"', GREY)
    c.box(170, 60, 100, 50, "tokenizer\nencode", BLUE)
    c.box(305, 60, 135, 50, "model\n(one forward pass)", BLUE, size=12, bold=True)
    c.box(464, 60, 122, 50, "logits → next-\ntoken probabilities", BLUE, size=12)
    c.box(620, 60, 120, 50, "sample\n(greedy: argmax)", ORANGE)
    c.arrow(130, 85, 170, 85)
    c.arrow(270, 85, 305, 85, "ids")
    c.arrow(440, 85, 464, 85)
    c.arrow(586, 85, 620, 85)
    c.path("M680,110 L680,160 L370,160 L370,112")
    c.text(520, 150, "append the id; repeat until EOS or max_new_tokens", size=12, color=ORANGE)
    c.box(470, 195, 120, 40, "tokenizer decode", BLUE, size=12)
    c.box(630, 195, 110, 40, '" not to be"', GREY)
    c.arrow(590, 215, 630, 215)
    c.path("M420,160 L420,215 L470,215", dashed=True)
    c.text(20, 150, "one pass per new token:", size=12, anchor="start")
    c.text(20, 166, "a 500-token answer is", size=12, anchor="start")
    c.text(20, 182, "~500 forward passes", size=12, anchor="start")
    return c


def prefill_decode() -> Canvas:
    c = Canvas(760, 270, "Prefill runs the whole prompt in one pass; decode runs one token per pass")
    c.text(380, 24, "Prefill vs decode (lesson 02)", size=15, bold=True)
    c.text(190, 55, "prefill: the prompt, all at once", size=13, bold=True, color=BLUE)
    for i in range(8):
        c.cell(40 + i * 36, 70, 34, 30, BLUE, f"t{i + 1}")
    c.arrow(184, 102, 184, 130)
    c.box(60, 130, 250, 44, "one forward pass over 8 tokens\n→ fills the KV cache, 1st token", BLUE, size=12)
    c.text(185, 200, "weights read once for many tokens:", size=12)
    c.text(185, 216, "compute-bound (high arithmetic intensity)", size=12, bold=True)
    c.text(185, 240, "sets the time to first token (TTFT)", size=12, color=BLUE)
    c.line(380, 50, 380, 250, color=GREY, dashed=True)
    c.text(570, 55, "decode: one new token per pass", size=13, bold=True, color=ORANGE)
    for s in range(4):
        y = 70 + s * 30
        c.cell(420, y, 30, 24, ORANGE, f"t{9 + s}")
        c.arrow(452, y + 12, 490, y + 12)
        c.box(490, y - 2, 180, 26, f"pass {s + 1}: 1 token + cache", ORANGE, size=11)
    c.text(570, 200, "all weights read for one token:", size=12)
    c.text(570, 216, "memory-bound (low arithmetic intensity)", size=12, bold=True)
    c.text(570, 240, "sets the time per output token (TPOT)", size=12, color=ORANGE)
    return c


def kv_cache() -> Canvas:
    c = Canvas(760, 280, "The KV cache grows by one row per step; the new query attends to all of it")
    c.text(380, 24, "The KV cache (lesson 03)", size=15, bold=True)
    for s in range(4):
        x0 = 30 + s * 185
        c.text(x0 + 75, 55, f"step {s + 1}" + (" (prefill)" if s == 0 else ""), size=12, bold=True)
        n = 3 + s
        for i in range(n):
            new = (s > 0 and i == n - 1) or s == 0
            c.cell(x0 + 10, 68 + i * 24, 60, 22, GREEN if not new else ORANGE, f"K{i + 1}")
            c.cell(x0 + 76, 68 + i * 24, 60, 22, GREEN if not new else ORANGE, f"V{i + 1}")
        qy = 68 + n * 24 + 12
        c.box(x0 + 20, qy, 106, 26, f"q{n} attends to 1..{n}", PURPLE, size=11)
    c.cell(40, 255, 14, 14, ORANGE)
    c.text(60, 266, "computed this step (K, V of the new token only)", size=12, anchor="start")
    c.cell(420, 255, 14, 14, GREEN)
    c.text(440, 266, "read from the cache, never recomputed", size=12, anchor="start")
    return c


def roofline() -> Canvas:
    c = Canvas(640, 330, "The roofline: time is bound by bandwidth at low intensity and by compute at high")
    c.text(320, 24, "The roofline (lesson 04)", size=15, bold=True)
    x0, y0, x1, y1 = 80, 280, 600, 50
    c.arrow(x0, y0, x1 + 10, y0)
    c.arrow(x0, y0, x0, y1 - 10)
    c.text((x0 + x1) / 2, 318, "arithmetic intensity (FLOPs per byte read), log scale", size=12)
    c.text(30, 165, "FLOP/s", size=12)
    c.text(30, 181, "(log)", size=12)
    ridge = (340, 90)
    c.line(x0, 260, ridge[0], ridge[1], color=BLUE, width=3)
    c.line(ridge[0], ridge[1], x1, ridge[1], color=RED, width=3)
    c.text(150, 130, "memory-bound:", size=12, color=BLUE, bold=True)
    c.text(150, 146, "bandwidth × intensity", size=12, color=BLUE)
    c.text(470, 80, "compute-bound: peak FLOP/s", size=12, color=RED, bold=True)
    c.line(ridge[0], ridge[1], ridge[0], y0, color=GREY, dashed=True)
    c.text(ridge[0], y0 + 16, "ridge point", size=11, color=GREY)
    c.parts.append(f'<circle cx="130" cy="226" r="7" fill="{ORANGE}"/>')
    c.text(140, 246, "decode, batch 1 (~1 FLOP/byte)", size=11, anchor="start", color=ORANGE)
    c.parts.append(f'<circle cx="250" cy="153" r="7" fill="{ORANGE}" fill-opacity="0.6"/>')
    c.text(262, 172, "decode, batch 64", size=11, anchor="start", color=ORANGE)
    c.parts.append(f'<circle cx="520" cy="90" r="7" fill="{BLUE}"/>')
    c.text(520, 112, "prefill (many tokens)", size=11, color=BLUE)
    return c


def kv_bytes() -> Canvas:
    c = Canvas(760, 290, "What one token costs in the KV cache: a key and a value vector per KV head, "
               "in every layer")
    c.text(380, 24, "The KV cache's bytes per token (lesson 05)", size=15, bold=True)
    c.text(150, 52, "one token, all layers", size=12, bold=True)
    for layer in range(4):
        y = 64 + layer * 44
        c.text(40, y + 24, f"layer {layer + 1}" if layer < 3 else "layer L", size=11, anchor="start")
        for h in range(3):
            c.cell(95 + h * 34, y, 32, 16, GREEN, "K" if h == 0 else "")
            c.cell(95 + h * 34, y + 18, 32, 16, ORANGE, "V" if h == 0 else "")
        c.text(210, y + 24, "× KV heads", size=11, anchor="start", color=GREY)
    c.text(150, 252, "each cell: head dim values × bytes per value", size=11)
    c.box(330, 60, 410, 64, "bytes per token = 2 (K and V) × layers × KV heads\n× head dim × bytes per value",
          BLUE, size=13)
    c.text(535, 150, "Llama-3-8B, FP16: 2 × 32 × 8 × 128 × 2 = 131,072 B = 128 KiB", size=12)
    c.box(330, 175, 410, 44, "cache = bytes per token × tokens × sequences", GREEN, size=13, bold=True)
    c.text(535, 244, "linear in every factor: a 4K-token context of 32 sequences", size=12)
    c.text(535, 260, "is 16 GiB, as much as the model's weights", size=12)
    return c


BATCH_PROMPTS = [8, 3, 6, 2]  # the batched-step diagram's prompt lengths (tokens), one per row


def batched_step() -> Canvas:
    c = Canvas(760, 300, "One decode step for a batch: prompts left-padded to end at one slot, each "
               "row's padding masked, every weight read once for all rows")
    c.text(380, 24, "One decode step, many rows (lesson 07)", size=15, bold=True)
    n, u = max(BATCH_PROMPTS), 26
    c.text(40, 52, "prompts, left-padded (slots →)", size=12, bold=True, anchor="start")
    for b, length in enumerate(BATCH_PROMPTS):
        y = 64 + b * 30
        c.text(34, y + 17, f"row {b}", size=11, anchor="end")
        for k in range(n):
            if k < n - length:
                c.cell(40 + k * u, y, u - 2, 24, LIGHT[GREY])
            else:
                c.cell(40 + k * u, y, u - 2, 24, BLUE)
        c.cell(40 + n * u + 6, y, u - 2, 24, GREEN, "+1")
    c.text(40 + n * u + 18, 198, "new", size=11)
    c.text(40 + n * u + 18, 211, "slot", size=11)
    c.box(330, 80, 150, 56, "weights W\n(read once per step)", ORANGE, size=12, bold=True)
    c.arrow(290, 108, 330, 108, "4 rows")
    c.box(520, 80, 220, 56, "logits (4 × vocab)\n→ 4 next tokens, one per row", GREEN, size=12)
    c.arrow(480, 108, 520, 108)
    c.text(535, 165, "one matrix product of 4 rows instead of 4 products", size=12)
    c.text(535, 181, "of 1 row: the bytes read stay, the FLOPs grow", size=12)
    c.cell(40, 232, 14, 14, LIGHT[GREY])
    c.text(60, 243, "padding: masked, never attended to", size=12, anchor="start")
    c.cell(300, 232, 14, 14, BLUE)
    c.text(320, 243, "a prompt token", size=12, anchor="start")
    c.cell(450, 232, 14, 14, GREEN)
    c.text(470, 243, "every row's new token, written at one slot", size=12, anchor="start")
    c.text(40, 280, "each row's position counts from its first real token: position = slot − start "
           "(start = its padding)", size=12, anchor="start")
    return c


def paged_blocks() -> Canvas:
    c = Canvas(760, 300, "Paged KV cache: each sequence's logical blocks map through a block table to "
               "physical blocks anywhere in one pool")
    c.text(380, 24, "Paged KV cache and the block table (lesson 08)", size=15, bold=True)
    c.text(110, 55, "sequences (logical blocks)", size=12, bold=True)
    seqs = {"A": (BLUE, [3, 0, 5]), "B": (ORANGE, [1, 6])}
    y = 70
    for name, (color, table) in seqs.items():
        c.text(30, y + 20, name, size=14, bold=True, color=color)
        for j, _ in enumerate(table):
            c.cell(50 + j * 62, y, 58, 30, color, f"{name}{j}")
        y += 60
    c.text(110, 210, "last block partly empty:", size=11)
    c.text(110, 224, "waste < 1 block per sequence", size=11)
    c.text(345, 55, "block tables", size=12, bold=True)
    c.box(290, 70, 110, 30, "A: [3, 0, 5]", BLUE, size=12)
    c.box(290, 130, 110, 30, "B: [1, 6]", ORANGE, size=12)
    c.arrow(240, 85, 290, 85)
    c.arrow(178, 145, 290, 145)
    c.text(590, 55, "physical pool (block size 16 tokens)", size=12, bold=True)
    owner = {3: ("A0", BLUE), 0: ("A1", BLUE), 5: ("A2", BLUE), 1: ("B0", ORANGE), 6: ("B1", ORANGE)}
    for b in range(8):
        x = 450 + (b % 4) * 72
        yy = 70 + (b // 4) * 60
        label, color = owner.get(b, ("free", GREY))
        c.cell(x, yy, 66, 40, color, label, size=12)
        c.text(x + 33, yy + 54, f"#{b}", size=10, color=GREY)
    c.arrow(400, 85, 450, 90)
    c.arrow(400, 145, 450, 150)
    c.text(380, 270, "a reservation per sequence for the whole context wastes most of the cache;",
           size=12)
    c.text(380, 286, "blocks on demand waste about half a block per sequence", size=12)
    return c


TOP_P, TOP_P_HEIGHTS = 0.9, [60, 44, 30, 20, 12, 7, 4]  # bar heights: probabilities ∝ height


def top_p_kept(heights: list[float], p: float) -> int:
    """How many of the tokens with these probabilities (∝ heights) `apply_top_p` keeps."""
    probs = torch.tensor(heights, dtype=torch.float32) / sum(heights)
    return int(torch.isfinite(apply_top_p(probs.log()[None], p)).sum())


def sampling() -> Canvas:
    c = Canvas(760, 250, "From logits to a token: penalty, temperature, top-k, top-p, then a draw")
    c.text(380, 24, "Sampling, step by step (lesson 06)", size=15, bold=True)
    steps = [("logits", GREY, "one score\nper token"), ("repetition\npenalty", PURPLE, "seen tokens\nscored down"),
             ("temperature", ORANGE, "logits / T:\nsharper or flatter"),
             ("top-k", BLUE, "keep the k\nbest"), ("top-p", BLUE, "keep the smallest\nset with mass ≥ p"),
             ("softmax +\ndraw", GREEN, "sample one\ntoken")]
    for i, (name, color, note) in enumerate(steps):
        x = 20 + i * 123
        c.box(x, 60, 105, 50, name, color, size=12, bold=True)
        c.text(x + 52, 132, note.split("\n")[0], size=11)
        c.text(x + 52, 146, note.split("\n")[1], size=11)
        if i:
            c.arrow(x - 18, 85, x, 85)
    heights = TOP_P_HEIGHTS
    kept = top_p_kept(heights, TOP_P)
    for j, h in enumerate(heights):
        color = BLUE if j < kept else RED
        c.cell(520 + j * 26, 235 - h, 22, h, color)
    c.text(600, 166, f"top-p = {TOP_P} on {len(heights)} tokens: {kept} kept", size=11)
    c.text(500, 232, "kept", size=11, color=BLUE, anchor="end")
    c.text(712, 232, "cut", size=11, color=RED, anchor="start")
    c.text(30, 190, "temperature 0 (or top-k 1) is greedy decoding: always the highest score.",
           size=12, anchor="start")
    c.text(30, 210, "minifer applies the processors in this order (minifer/sampling.py).", size=12,
           anchor="start")
    return c


def batching() -> Canvas:
    c = Canvas(760, 300, "Static batching holds a group until its longest request ends; continuous "
               "batching refills a freed slot at the next step")
    c.text(380, 24, "Static vs continuous batching (lesson 08)", size=15, bold=True)
    lengths = [3, 9, 4, 6, 2, 5]
    u = 24

    def row(y: float, start: int, n: int, color: str, label: str) -> None:
        c.text(95, y + 14, label, size=11, anchor="end")
        for k in range(n):
            c.cell(100 + (start + k) * u, y, u - 2, 18, color)

    c.text(100, 52, "static: 2 slots, groups of 2 (steps →)", size=12, bold=True, anchor="start")
    t = 0
    for g in range(0, 6, 2):
        longest = max(lengths[g:g + 2])
        for r in (g, g + 1):
            y = 60 + (r % 2) * 20
            row(y, t, lengths[r], BLUE, f"slot {r % 2 + 1}" if g == 0 else "")
            c.text(100 + t * u + 3, y + 13, str(r + 1), size=10, color="#ffffff", anchor="start")
            for k in range(lengths[r], longest):
                c.cell(100 + (t + k) * u, y, u - 2, 18, LIGHT[ORANGE])
        t += longest
    c.text(100 + t * u + 8, 88, f"{t} steps", size=12, anchor="start", bold=True)
    c.text(100, 150, "continuous: 2 slots, a waiting request joins as soon as one is free",
           size=12, bold=True, anchor="start")
    slots = [0, 0]
    for r, n in enumerate(lengths):
        s = min(range(2), key=lambda i: slots[i])
        row(160 + s * 20, slots[s], n, GREEN, f"slot {s + 1}" if r < 2 else "")
        c.text(100 + slots[s] * u + 3, 160 + s * 20 + 13, str(r + 1), size=10, color="#ffffff",
               anchor="start")
        slots[s] += n
    c.text(100 + max(slots) * u + 8, 188, f"{max(slots)} steps", size=12, anchor="start", bold=True)
    c.cell(100, 250, 14, 14, BLUE)
    c.text(120, 261, "a request's decode steps", size=12, anchor="start")
    c.cell(310, 250, 14, 14, LIGHT[ORANGE])
    c.text(330, 261, "slot held, finished: nobody may join", size=12, anchor="start")
    c.text(100, 288, "same tokens, fewer steps: the gain grows with the spread of answer lengths", size=12, anchor="start")
    return c


INT8_ROW = [0.12, -0.50, 0.03, 0.25]


def int8_row(row: list[float]) -> tuple[list[float], list[int], list[float], float]:
    """One weight row through `minifer.quantization.quantize_int8`: (w, q, w' = q × scale, scale)."""
    w = torch.tensor([row], dtype=torch.float32)
    q, scale = quantize_int8(w)
    return row, q[0].tolist(), (q.float() * scale[:, None])[0].tolist(), float(scale[0])


def quantization() -> Canvas:
    c = Canvas(760, 250, "int8 quantization of one weight row: a scale, rounding, and back")
    c.text(380, 24, "Quantizing a weight row to int8 (lesson 09)", size=15, bold=True)
    w_row, q_row, d_row, scale = int8_row(INT8_ROW)
    w = [f"{v:.2f}" for v in w_row]
    q = [str(v) for v in q_row]
    d = [f"{v:.3f}" for v in d_row]
    for label, vals, color, y in (("fp32 w (4 bytes each)", w, BLUE, 60), ("int8 q (1 byte each)", q, ORANGE, 140)):
        c.text(150, y + 20, label, size=12, anchor="end")
        for i, v in enumerate(vals):
            c.cell(160 + i * 62, y, 58, 30, color, v, size=12)
    c.arrow(284, 92, 284, 138)
    c.text(300, 112, f"scale = max|w| / 127 = {max(abs(v) for v in w_row):.2f} / 127 ≈ {scale:.5f}",
           size=12, anchor="start")
    c.text(300, 128, "q = round(w / scale), clamped to [-127, 127]", size=12, anchor="start")
    c.box(470, 140, 250, 30, "stored: q and one scale per row", GREY, size=12)
    c.arrow(284, 172, 284, 198)
    c.text(300, 190, "dequantize: w' = q × scale", size=12, anchor="start")
    c.text(150, 222, "w' ≈ w", size=12, anchor="end")
    for i, v in enumerate(d):
        c.cell(160 + i * 62, 202, 58, 30, GREEN, v, size=12)
    c.text(430, 214, "error ≤ scale / 2 per weight;", size=12, anchor="start")
    c.text(430, 230, "4× fewer bytes to read per step", size=12, anchor="start")
    return c


def speculative() -> Canvas:
    c = Canvas(760, 270, "Speculative decoding: a small draft proposes k tokens, the target checks "
               "them in one pass and keeps the agreeing prefix plus one of its own")
    c.text(380, 24, "Speculative decoding: propose, verify (lesson 10)", size=15, bold=True)
    c.box(20, 60, 130, 44, "draft model\n(small, fast)", PURPLE, size=12)
    for i, t in enumerate(["the", "cat", "sat", "on"]):
        c.cell(180 + i * 60, 66, 56, 32, PURPLE, t, size=12)
    c.text(300, 56, "k = 4 proposals, one cheap step each", size=11)
    c.arrow(150, 82, 180, 82)
    c.box(20, 140, 130, 44, "target model\n(one forward pass)", BLUE, size=12)
    c.text(300, 132, "verify all 4 at once", size=11)
    marks = [("the", GREEN, "✓"), ("cat", GREEN, "✓"), ("sat", RED, "✗"), ("on", GREY, "")]
    for i, (t, color, m) in enumerate(marks):
        c.cell(180 + i * 60, 146, 56, 32, color, f"{t} {m}".strip(), size=12)
    c.cell(180 + 2 * 60, 200, 56, 32, BLUE, "lay", size=12)
    c.arrow(208 + 2 * 60, 178, 208 + 2 * 60, 200)
    c.text(208 + 2 * 60, 250, "target's own token", size=11, color=BLUE)
    c.arrow(150, 162, 180, 162)
    c.text(440, 150, "greedy: accept while the draft's token is", size=12, anchor="start")
    c.text(440, 166, "the target's argmax; sampling: accept with", size=12, anchor="start")
    c.text(440, 182, "probability min(1, p_target / p_draft)", size=12, anchor="start")
    c.text(440, 214, "here: 2 accepted + 1 from the target =", size=12, anchor="start")
    c.text(440, 230, "3 tokens for one target pass; output", size=12, anchor="start")
    c.text(440, 246, "identical to the target alone", size=12, anchor="start", bold=True)
    return c


def server() -> Canvas:
    c = Canvas(760, 260, "A request's path through the OpenAI-compatible server and the engine loop")
    c.text(380, 24, "The server's request path (lesson 11)", size=15, bold=True)
    c.box(20, 70, 120, 60, "client\n(httpx, openai)", GREY, size=12)
    c.box(190, 70, 150, 60, "HTTP server\nPOST /v1/completions\nvalidate, tokenize", BLUE, size=11)
    c.box(390, 70, 140, 60, "async engine\nqueue of requests", ORANGE, size=12)
    c.box(580, 70, 160, 60, "LLMEngine.step()\nschedule → one forward\n→ sample", GREEN, size=11)
    c.arrow(140, 90, 190, 90, "JSON")
    c.arrow(340, 90, 390, 90)
    c.arrow(530, 90, 580, 90)
    c.path("M700,130 C740,185 600,185 640,132")
    c.text(660, 190, "one step per iteration,", size=11)
    c.text(660, 204, "for all running requests", size=11)
    c.arrow(580, 118, 530, 118, "tokens", above=False)
    c.arrow(390, 118, 340, 118)
    c.arrow(190, 118, 140, 118, "SSE", above=False)
    c.text(20, 160, 'data: {"choices":[{"text":" To"}]}', size=11, anchor="start")
    c.text(20, 176, 'data: {"choices":[{"text":" be"}]}', size=11, anchor="start")
    c.text(20, 192, "data: [DONE]", size=11, anchor="start")
    c.text(330, 235, "the first line arrives after the prefill (TTFT); each later one after a decode step (TPOT)",
           size=12)
    return c


def tensor_parallel() -> Canvas:
    c = Canvas(760, 290, "Tensor parallelism: a column-parallel layer then a row-parallel layer, "
               "joined by one all-reduce")
    c.text(380, 24, "Tensor parallelism over 2 ranks (lesson 12)", size=15, bold=True)
    c.box(20, 110, 70, 50, "x\n(all ranks)", GREY, size=12)
    for r, color in enumerate((BLUE, ORANGE)):
        y = 60 + r * 110
        c.text(135, y - 6, f"rank {r}: W1 columns {'1–n/2' if r == 0 else 'n/2+1–n'}, W2 rows the same",
               size=11, color=color, anchor="start")
        c.box(130, y, 90, 50, f"x · W1[:, {r}]", color, size=12)
        c.box(260, y, 80, 50, "GELU", color, size=12)
        c.box(380, y, 110, 50, f"h{r} · W2[{r}, :]", color, size=12)
        c.text(435, y + 66, "partial sum", size=11, color=color)
        c.arrow(90, 135, 130, y + 25)
        c.arrow(220, y + 25, 260, y + 25)
        c.arrow(340, y + 25, 380, y + 25)
        c.arrow(490, y + 25, 540, 135)
    c.box(540, 105, 100, 60, "all-reduce\n(sum)", GREEN, size=12, bold=True)
    c.box(670, 110, 70, 50, "y\n(all ranks)", GREY, size=12)
    c.arrow(640, 135, 670, 135)
    c.text(380, 262, "each rank holds half of W1 (by columns) and half of W2 (by rows): half the weight "
           "bytes per step,", size=12)
    c.text(380, 278, "and one all-reduce of the activations per layer — equal to the full layer",
           size=12)
    return c


def fast_seam() -> Canvas:
    c = Canvas(760, 300, "The core calls plain functions in one seam, minifer.hooks; minifer.fast "
               "puts faster versions there, each tested equal to the plain one")
    c.text(380, 24, "Where the speed-ups plug in (appendix, lesson 13)", size=15, bold=True)
    c.text(120, 55, "the core (lessons 01-12)", size=12, bold=True, color=BLUE)
    c.text(380, 55, "minifer.hooks: the seam", size=12, bold=True, color=GREY)
    c.text(640, 55, "minifer.fast: the speed-ups", size=12, bold=True, color=GREEN)
    rows = [("threads ('auto')", "generation_threads, serving_threads", "thread governor"),
            ("one decode step", "decode_function", "lean / compiled step"),
            ("linear layers", "prepare_bf16, int8_matmul", "prepacked, C++ GEMV"),
            ("greedy pick", "argmax", "argmax in chunks"),
            ("serving attention", "packed_attention", "planned once per step")]
    for i, (core, hook, fast) in enumerate(rows):
        y = 68 + i * 40
        c.box(30, y, 180, 30, core, BLUE, size=12)
        c.box(270, y, 220, 30, hook, GREY, size=11)
        c.box(550, y, 180, 30, fast, GREEN, size=12)
        c.arrow(210, y + 15, 270, y + 15)
        c.arrow(550, y + 15, 490, y + 15, dashed=True)
    c.text(380, 286, "speed-ups off: the seam keeps the plain reference, with the same greedy tokens",
           size=12)
    return c


def your_engine() -> Canvas:
    c = Canvas(760, 330, "Your engine: the pieces written in lessons 01 to 11, one request's path "
               "through them from the HTTP endpoint to the streamed tokens")
    c.text(380, 24, "Your engine, assembled (lesson 14)", size=15, bold=True)
    c.box(20, 60, 130, 56, "client, load loop\nTTFT, ITL (11)", GREY, size=12)
    c.box(200, 60, 150, 56, "HTTP endpoint\nserver-sent events (11)", BLUE, size=12)
    c.box(400, 60, 150, 56, "scheduler: admit,\ndecode, preempt (08)", ORANGE, size=12)
    c.box(600, 60, 140, 56, "blocks and block\ntables (08)", ORANGE, size=12)
    c.arrow(150, 80, 200, 80, "JSON")
    c.arrow(350, 80, 400, 80)
    c.arrow(550, 88, 600, 88)
    c.box(200, 160, 540, 70, "", GREEN)
    c.text(470, 180, "one forward pass for every running request (02, 03, 07)", size=13, bold=True)
    c.box(212, 192, 160, 30, "Int8Linear layers (09)", GREEN, size=11, fill="#ffffff")
    c.box(386, 192, 170, 30, "attention over own blocks", GREEN, size=11, fill="#ffffff")
    c.box(570, 192, 160, 30, "KV cache in the pool", GREEN, size=11, fill="#ffffff")
    c.arrow(475, 116, 475, 160)
    c.box(200, 262, 250, 50, "sampler: temperature, top-k,\ntop-p, a seeded draw (06)", PURPLE, size=12)
    c.box(490, 262, 250, 50, "draft proposes, target verifies,\ncaches roll back (10)", PURPLE, size=12)
    c.arrow(330, 230, 330, 262)
    c.arrow(610, 230, 610, 262)
    c.path("M200,287 L90,287 L90,116")
    c.text(145, 278, "tokens, streamed", size=11)
    c.text(20, 150, "the loop of 01:", size=12, anchor="start")
    c.text(20, 166, "one step per token,", size=12, anchor="start")
    c.text(20, 182, "every request at once", size=12, anchor="start")
    return c


DIAGRAMS = {
    "01_generation_loop.svg": generation_loop,
    "02_prefill_vs_decode.svg": prefill_decode,
    "03_kv_cache.svg": kv_cache,
    "04_roofline.svg": roofline,
    "05_kv_bytes.svg": kv_bytes,
    "06_sampling.svg": sampling,
    "07_batched_step.svg": batched_step,
    "08_paged_blocks.svg": paged_blocks,
    "08_batching.svg": batching,
    "09_quantization.svg": quantization,
    "10_speculative.svg": speculative,
    "11_server.svg": server,
    "12_tensor_parallel.svg": tensor_parallel,
    "13_fast_seam.svg": fast_seam,
    "14_your_engine.svg": your_engine,
}


def draw_all(out: pathlib.Path) -> list[pathlib.Path]:
    """Write every diagram into `out`; return the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in DIAGRAMS.items():
        canvas = draw()
        if canvas.overflowing():
            raise ValueError(f"{name}: text does not fit: " + "; ".join(canvas.overflowing()))
        path = out / name
        path.write_text(canvas.svg(), encoding="utf-8")
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path,
                    default=pathlib.Path(__file__).resolve().parent.parent / "course" / "minifer_course" / "lessons" / "diagrams")
    for path in draw_all(ap.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
