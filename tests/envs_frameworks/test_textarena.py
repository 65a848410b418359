"""TextArena games trained unchanged (``data.source.textarena``), in sync and fully async: a game
is one trajectory, the model's moves its turns, the game's outcome (TextArena's) its reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlasync.envs import EnvError, make_environment

ta = pytest.importorskip("textarena", reason="needs textarena: the envs tier, `make test-envs`")

from frameworks import run_yaml  # noqa: E402

pytestmark = pytest.mark.timeout(900)

BOTS = r'''
import re


def first_free(observation, player):
    """A scripted opponent: the first move the board still offers."""
    moves = re.findall(r"'(\[\d+\])'", observation.rsplit("Available Moves:", 1)[-1])
    return moves[0] if moves else "[0]"
'''


def _first_free(observation: str, player: int) -> str:
    namespace: dict[str, object] = {}
    exec(BOTS, namespace)  # the very opponent the run had
    return namespace["first_free"](observation, player)  # type: ignore[operator, no-any-return]


def _replayed_reward(moves: list[str], max_turns: int) -> float:
    """The game played again with the model's recorded moves against the same opponent."""
    env = ta.make("TicTacToe-v0")
    env.reset(num_players=2, seed=0)
    done, ours = False, iter(moves)
    while not done:
        player, observation = env.get_observation()
        move = next(ours, None) if player == 0 else _first_free(observation, player)
        if move is None:  # cut at max_turns
            return 0.0
        done, _ = env.step(move)
    rewards, _ = env.close()
    return float(rewards[0])


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_a_game_against_a_scripted_opponent_is_rewarded_by_its_outcome(
    tmp_path: Path, nano_model_dir: Path, mode: str
) -> None:
    (tmp_path / "bots.py").write_text(BOTS)
    source = "data:\n  source:\n    textarena: {game: TicTacToe-v0, players: 2, opponent: ./bots.py:first_free, max_turns: 5}\n"
    run = run_yaml(tmp_path, source, model=nano_model_dir, mode=mode, prompts=2)
    for trace in run["traces"]:
        assert trace["messages"][0]["content"].startswith("[GAME] You are Player 0 in Tic Tac Toe.")
        moves = [m["content"] for m in trace["messages"] if m["role"] == "assistant"]
        assert trace["reward"] == _replayed_reward(moves, 5), trace
    assert {r["reward"] for r in run["steps"]} <= {-1.0, 0.0, 1.0} or all(
        -1.0 <= r["reward"] <= 1.0 for r in run["steps"]
    )


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_self_play_trains_our_seat_against_the_policy_itself(
    tmp_path: Path, nano_model_dir: Path, mode: str
) -> None:
    """``opponent: self``: the policy plays both seats through the run's endpoint; only our seat's
    conversation is the trajectory (the other seat's calls are sent aside, not trained on)."""
    source = (
        "data:\n  source:\n    textarena: {game: TicTacToe-v0, players: 2, opponent: self, max_turns: 3}\n"
    )
    run = run_yaml(tmp_path, source, model=nano_model_dir, mode=mode, prompts=2)
    assert run["traces"]
    for trace in run["traces"]:
        text = " ".join(str(m["content"]) for m in trace["messages"])
        assert trace["messages"][0]["content"].startswith("[GAME] You are Player 0 in Tic Tac Toe.")
        assert "You are Player 1" not in text  # the other seat's conversation is not ours
        assert -1.0 <= trace["reward"] <= 1.0


def test_a_wrong_game_or_a_missing_opponent_is_named(tmp_path: Path) -> None:
    with pytest.raises(EnvError, match=r"no game 'TicTacToe-v9' \(did you mean TicTacToe-v0"):
        make_environment({"textarena": {"game": "TicTacToe-v9"}}, seed=0)
    with pytest.raises(EnvError, match=r"needs an opponent"):
        make_environment({"textarena": {"game": "TicTacToe-v0", "players": 2}}, seed=0)
    with pytest.raises(EnvError, match=r"opponent: .*cannot import"):
        make_environment(
            {"textarena": {"game": "TicTacToe-v0", "players": 2, "opponent": "no_module:bot"}}, seed=0
        )
    with pytest.raises(EnvError, match=r"url required"):
        make_environment(
            {"textarena": {"game": "TicTacToe-v0", "players": 2, "opponent": {"model": "m"}}}, seed=0
        )
    env = make_environment({"textarena": {"game": "GuessTheNumber-v0", "size": 5}}, seed=3)
    train, val = env.rows("train"), env.rows("val", 3)
    assert len(train) == 5 and not {r["textarena_seed"] for r in train} & {r["textarena_seed"] for r in val}
