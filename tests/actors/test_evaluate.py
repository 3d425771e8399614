"""The evaluator (actors/evaluate.py): when it validates, what a row holds, and that the CSV round-trips. <1 s."""

from __future__ import annotations

import random
from itertools import pairwise

from actors.evaluate import ValidationEpisode, append_row, is_due, read_rows, summarize


def test_due_at_zero_then_every_n_and_at_the_final_version() -> None:
    # every = 5, total = 12: validate at 0, at the first read >= 5, >= 10, then at 12 (final), then never.
    assert is_due(0, None, 5, 12)
    assert not is_due(4, 0, 5, 12)
    assert is_due(5, 0, 5, 12)
    assert is_due(7, 0, 5, 12)  # polling skipped 5 and 6: the first version past it counts
    assert not is_due(9, 7, 5, 12)  # 7 was validated; next due at 10
    assert is_due(10, 7, 5, 12)
    assert not is_due(11, 10, 5, 12)
    assert is_due(12, 10, 5, 12)  # the final version, though not a multiple of 5
    assert not is_due(12, 12, 5, 12)


def test_due_never_skips_a_multiple_and_always_ends_at_total() -> None:
    rng = random.Random(0)
    for _ in range(200):
        every, total = rng.randint(1, 7), rng.randint(1, 40)
        version, last, done = 0, None, []
        while last is None or last < total:
            if is_due(version, last, every, total):
                done.append(version)
                last = version
            version = min(total, version + rng.randint(0, 3))  # the learner moves 0-3 versions per poll
        assert done[0] == 0 and done[-1] == total
        assert all(b > a for a, b in pairwise(done))
        # At most one validation per multiple of `every` (each is due once), plus version 0 and the final one.
        assert len(done) <= total // every + 2
        assert all(b // every > a // every or b == total for a, b in pairwise(done))


def test_summarize_by_hand() -> None:
    # 4 episodes: 2 successes of 3 and 5 steps (return 1 each), 2 failures of 8 steps with 1 and 3 invalid.
    # success 2/4 = 0.5; return (1 + 1 + 0 + 0) / 4 = 0.5; invalid 4 / 24 steps; mean length 24 / 4 = 6.
    eps = [
        ValidationEpisode(True, 1.0, 3, 0),
        ValidationEpisode(True, 1.0, 5, 0),
        ValidationEpisode(False, 0.0, 8, 1),
        ValidationEpisode(False, 0.0, 8, 3),
    ]
    row = summarize(eps, version=10, version_end=11, wall_s=12.345, trajectories=320)
    assert (row.val_success_rate, row.val_return, row.val_steps) == (0.5, 0.5, 6.0)
    assert row.val_invalid_rate == 4 / 24
    assert (row.version, row.version_end, row.trajectories_trained, row.episodes, row.wall_s) == (10, 11, 320, 4, 12.35)


def test_csv_round_trip(tmp_path) -> None:
    path = tmp_path / "validation.csv"
    assert read_rows(path) == []
    a = summarize([ValidationEpisode(True, 1.0, 2, 0)], 0, 0, 1.0, 0)
    b = summarize([ValidationEpisode(False, 0.0, 4, 2)], 5, 6, 9.5, 160)
    append_row(path, a)
    append_row(path, b)
    rows = read_rows(path)
    assert [r["version"] for r in rows] == [0.0, 5.0]
    assert rows[1]["val_invalid_rate"] == 0.5 and rows[1]["trajectories_trained"] == 160.0


def test_a_failing_episode_is_played_again_on_its_seed_then_its_validation_is_given_up(monkeypatch) -> None:
    import asyncio

    import pytest

    from actors import evaluate
    from engines.client import EngineError

    calls: list[int] = []

    def failing(times: int):
        async def play(spec, engine, tokenizer, seed):
            calls.append(seed)
            if len(calls) <= times:
                raise EngineError("no answer within 120.0 s")
            return ValidationEpisode(True, 1.0, 1, 0)

        return play

    monkeypatch.setattr(evaluate, "play_episode", failing(evaluate.EPISODE_TRIES - 1))
    assert asyncio.run(evaluate.play_with_retries(None, None, None, 7)).success
    assert calls == [7] * evaluate.EPISODE_TRIES  # every try on the same seed

    calls.clear()
    monkeypatch.setattr(evaluate, "play_episode", failing(evaluate.EPISODE_TRIES))
    with pytest.raises(evaluate.ValidationFailed, match="seed 7 failed 3 times.*120.0 s"):
        asyncio.run(evaluate.play_with_retries(None, None, None, 7))
    assert calls == [7] * evaluate.EPISODE_TRIES
