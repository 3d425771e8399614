"""EZPoints and Points24 with `observation="image"`: the dealt cards' picture in `info["image"]`, of the
declared shape, byte-identical for the same deal, different for different deals, and legible: every card
is drawn where it should be, its rank in the corner and its suit below, each rank and suit told apart."""

import itertools

import numpy as np
import pytest

import envs
from envs.cards.deck import RANK_BOX, SUIT_BOX, SUITS, card_picture, render_hand

# By hand: cards are 48x64 with 4 px of table around and between them, so n cards are 64 + 2*4 = 72 px high
# and 4 + n * (48 + 4) wide; card i's left edge is at x = 4 + 52 * i.
CARD_W, CARD_H, GAP = 48, 64, 4
WHITE = (255, 255, 255)
GAMES = [("agentstream/EZPoints-v0", 2, (72, 108, 3)), ("agentstream/Points24-v0", 4, (72, 212, 3))]


def card_at(image: np.ndarray, i: int) -> np.ndarray:
    x = GAP + i * (CARD_W + GAP)
    return image[GAP : GAP + CARD_H, x : x + CARD_W]


def ink(region: np.ndarray) -> np.ndarray:
    """[H, W] bool: the pixels that are not the card's white."""
    return (region != WHITE).any(axis=-1)


def box(card: np.ndarray, x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
    return card[y0:y1, x0:x1]


def rank_region(card: np.ndarray) -> np.ndarray:
    return box(card, *RANK_BOX)


def suit_region(card: np.ndarray) -> np.ndarray:
    x, y, side = SUIT_BOX
    return box(card, x, y, x + side + 1, y + side + 1)


@pytest.mark.parametrize("name,n_cards,shape", GAMES)
def test_the_picture_has_the_declared_shape_and_is_the_same_for_the_same_deal(name, n_cards, shape) -> None:
    env, again, text = (envs.make(name, observation=o) for o in ("image", "image", "text"))
    for seed in range(5):
        obs, info = env.reset(seed=seed)
        image = info["image"]
        assert image.shape == shape and image.dtype == np.uint8
        assert again.reset(seed=seed)[1]["image"].tobytes() == image.tobytes()
        text_obs, text_info = text.reset(seed=seed)
        assert obs == text_obs and "image" not in text_info  # the text observation is unchanged
        # every step brings the picture, invalid ones too; the cards do not change during the episode
        for answer in (f"<action>{info['numbers'][0]}</action>", "no tag"):
            _, _, _, _, step_info = env.step(answer)
            assert step_info["image"].tobytes() == image.tobytes()


@pytest.mark.parametrize("name,n_cards,shape", GAMES)
def test_different_deals_give_different_pictures(name, n_cards, shape) -> None:
    env = envs.make(name, observation="image")
    pictures = {}
    for seed in range(12):
        _, info = env.reset(seed=seed)
        pictures.setdefault(tuple(env.cards), info["image"].tobytes())
    assert len(pictures) >= 6  # 12 seeds deal several distinct hands
    assert len(set(pictures.values())) == len(pictures)  # one picture per hand, none shared


@pytest.mark.parametrize("name,n_cards,shape", GAMES)
def test_every_card_is_drawn_in_its_place(name, n_cards, shape) -> None:
    env = envs.make(name, observation="image")
    for seed in range(5):
        _, info = env.reset(seed=seed)
        image = info["image"]
        table = tuple(image[0, 0])
        assert table != WHITE
        for i, (rank, suit) in enumerate(env.cards):
            card = card_at(image, i)
            assert tuple(card[CARD_H // 2, 2]) == WHITE  # a white card covers its place (left edge, mid-height)
            assert ink(rank_region(card)).sum() >= 20 and ink(suit_region(card)).sum() >= 100  # rank and suit drawn
            assert np.array_equal(card, card_picture(rank, suit))
            red = suit in ("hearts", "diamonds")
            r, g, b = rank_region(card)[ink(rank_region(card))].astype(int).mean(axis=0)
            assert (r > g + 100) == red  # hearts and diamonds in red, spades and clubs in black
        # the table shows between and around the cards
        for i in range(n_cards + 1):
            x = i * (CARD_W + GAP)
            assert (image[:, x : x + GAP] == table).all()
        assert (image[:GAP] == table).all() and (image[-GAP:] == table).all()


def test_ranks_and_suits_are_told_apart() -> None:
    # every rank's corner differs from every other rank's (same suit), and the corner depends on the rank
    # alone (the same ink in every suit); every suit's shape differs from every other's and not on the rank
    corners = {rank: ink(rank_region(card_picture(rank, "spades"))) for rank in range(1, 14)}
    for a, b in itertools.combinations(range(1, 14), 2):
        assert not np.array_equal(corners[a], corners[b]), (a, b)
    for rank, suit in itertools.product(range(1, 14), SUITS):
        assert np.array_equal(ink(rank_region(card_picture(rank, suit))), corners[rank])
    shapes = {suit: ink(suit_region(card_picture(1, suit))) for suit in SUITS}
    for a, b in itertools.combinations(SUITS, 2):
        assert not np.array_equal(shapes[a], shapes[b]), (a, b)
    for rank, suit in itertools.product(range(1, 14), SUITS):
        assert np.array_equal(ink(suit_region(card_picture(rank, suit))), shapes[suit])
    # two hands that differ in one rank differ exactly in that card's rank corner
    a, b = render_hand([(3, "clubs"), (9, "hearts")]), render_hand([(3, "clubs"), (8, "hearts")])
    diff = (a != b).any(axis=-1)
    x0, y0, x1, y1 = RANK_BOX
    second = GAP + CARD_W + GAP
    assert diff[GAP + y0 : GAP + y1, second + x0 : second + x1].any()
    diff[GAP + y0 : GAP + y1, second + x0 : second + x1] = False
    assert not diff.any()


def test_an_unknown_observation_is_refused() -> None:
    for name, _, _ in GAMES:
        with pytest.raises(ValueError, match="observation='pixels': use 'text' or 'image'"):
            envs.make(name, observation="pixels")
    with pytest.raises(ValueError, match="no card"):
        card_picture(14, "hearts")
