"""Playing cards: their names, and their pictures for vision-language models (`observation="image"`).

A card's picture is drawn here with Pillow, nothing loaded from disk: a white rounded card on a green
table, its rank in the top-left corner in Pillow's built-in bitmap font (scaled up 3x, nearest neighbour)
and its suit below as a simple shape, red for hearts and diamonds, black for spades and clubs. Nothing in
it is anti-aliased or depends on a font file, so the same cards give byte-identical arrays.

    render_hand([(12, "hearts"), (2, "clubs")])   # uint8 [72, 108, 3]: two 48x64 cards, 4 px apart
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SUITS = ("hearts", "spades", "diamonds", "clubs")
RANK_NAMES = {1: "ace", 11: "jack", 12: "queen", 13: "king"}
RANK_LABELS = {1: "A", 11: "J", 12: "Q", 13: "K"}  # the corner label; other ranks show their number

Card = tuple[int, str]  # (rank 1-13, suit)

CARD_W, CARD_H, GAP = 48, 64, 4  # pixels: each card, and the table around and between cards
RANK_SCALE = 3  # the 6x11 bitmap glyphs drawn 18x33: legible at the small image sizes VLMs get
RANK_BOX = (3, 3, 3 + 2 * 6 * RANK_SCALE, 3 + 11 * RANK_SCALE)  # (x0, y0, x1, y1) in a card: where the rank goes
SUIT_BOX = (13, 38, 22)  # (x0, y0, side) in a card: the square the suit's shape fills
TABLE = (30, 110, 60)
WHITE, EDGE, RED, BLACK = (255, 255, 255), (60, 60, 60), (200, 30, 30), (20, 20, 20)


def card_name(card: Card) -> str:
    rank, suit = card
    return f"{RANK_NAMES.get(rank, str(rank))} of {suit}"


def hand_shape(n_cards: int) -> tuple[int, int, int]:
    """The shape of `render_hand`'s picture of `n_cards` cards: [H, W, 3]."""
    return CARD_H + 2 * GAP, n_cards * (CARD_W + GAP) + GAP, 3


def render_hand(cards: Sequence[Card]) -> np.ndarray:
    """The cards side by side on the table, left to right in order: uint8 [72, 4 + 52 * len(cards), 3]."""
    out = np.empty(hand_shape(len(cards)), dtype=np.uint8)
    out[:] = TABLE
    for i, (rank, suit) in enumerate(cards):
        x = GAP + i * (CARD_W + GAP)
        out[GAP : GAP + CARD_H, x : x + CARD_W] = card_picture(rank, suit)
    return out


@functools.lru_cache(maxsize=None)
def card_picture(rank: int, suit: str) -> np.ndarray:
    """One card, uint8 [CARD_H, CARD_W, 3] (read-only: cached and shared)."""
    if not 1 <= rank <= 13 or suit not in SUITS:
        raise ValueError(f"no card ({rank}, {suit!r}): ranks are 1-13, suits {', '.join(SUITS)}")
    color = RED if suit in ("hearts", "diamonds") else BLACK
    card = Image.new("RGB", (CARD_W, CARD_H), TABLE)
    draw = ImageDraw.Draw(card)
    draw.rounded_rectangle((0, 0, CARD_W - 1, CARD_H - 1), radius=6, fill=WHITE, outline=EDGE)
    label = _label_mask(RANK_LABELS.get(rank, str(rank)))
    card.paste(color, RANK_BOX[:2], label)
    _draw_suit(draw, suit, color)
    array = np.asarray(card, dtype=np.uint8).copy()
    array.setflags(write=False)
    return array


def _label_mask(text: str) -> Image.Image:
    """`text` in Pillow's built-in bitmap font, scaled `RANK_SCALE` times: a 1-bit-like "L" mask."""
    font = ImageFont.load_default_imagefont()
    _, _, w, h = font.getbbox(text)
    mask = Image.new("L", (w, h), 0)
    ImageDraw.Draw(mask).text((0, 0), text, fill=255, font=font)
    return mask.resize((w * RANK_SCALE, h * RANK_SCALE), Image.Resampling.NEAREST)


def _draw_suit(draw: ImageDraw.ImageDraw, suit: str, color: tuple[int, int, int]) -> None:
    """The suit as circles and polygons in the `SUIT_BOX` square (integer corners: exact pixels)."""
    x, y, s = SUIT_BOX
    r = s // 4
    if suit == "diamonds":
        draw.polygon([(x + s // 2, y), (x + s, y + s // 2), (x + s // 2, y + s), (x, y + s // 2)], fill=color)
    elif suit == "hearts":  # two lobes on top, a point at the bottom
        for cx in (x + r, x + 3 * r):
            draw.ellipse((cx - r, y, cx + r, y + 2 * r), fill=color)
        draw.polygon([(x, y + r), (x + s, y + r), (x + s // 2, y + s)], fill=color)
    elif suit == "spades":  # a point on top, two lobes below, a stem
        draw.polygon([(x + s // 2, y), (x, y + 3 * r), (x + s, y + 3 * r)], fill=color)
        for cx in (x + r, x + 3 * r):
            draw.ellipse((cx - r, y + 2 * r, cx + r, y + 4 * r - 2), fill=color)
        draw.polygon([(x + s // 2, y + 2 * r), (x + r, y + s), (x + 3 * r, y + s)], fill=color)
    else:  # clubs: three leaves and a stem
        for cx, cy in ((x + s // 2, y + r), (x + r, y + 2 * r + 1), (x + 3 * r, y + 2 * r + 1)):
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=color)
        draw.polygon([(x + s // 2, y + r), (x + r, y + s), (x + 3 * r, y + s)], fill=color)
