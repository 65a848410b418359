"""TextArena's games as environments: a game is one trajectory's conversation, its outcome the reward.

    data:
      source:
        textarena:
          game: TicTacToe-v0               # any id of TextArena's registry
          players: 2
          opponent: my_bots:first_free     # a function (observation, player id) -> move ...
          # opponent: {url: http://judge-host:8000/v1, model: frozen}   # ... or a second policy
          # opponent: self                 # ... or the policy being trained (self-play)

Each row is one game, played from its own seed. Our policy plays ``player`` (0: it moves first):
every time it is to move, the game's new observation (what appeared since its last turn) is a
user message and its reply the move, so a game is one multi-turn sample whose game turns are
masked. The other seats are played by ``opponent``: a Python function by import path (scripted;
sync or async), a model behind an OpenAI-compatible URL (a frozen copy, another model), or
``self``: the policy being trained, through the run's own endpoint and engines, each seat in a
conversation of its own as ours is. No opponent's calls are the trajectory's (self-play's are
sent ``X-Rlasync-Train: false``: answered, not trained on), so only our seat learns, against
the current policy. The reward is TextArena's for our player at the game's end (a
win 1, a loss -1, a draw 0, or the game's own scale); a game cut at ``max_turns`` of ours (or
4 x ``max_turns`` x ``players`` moves in all) scores ``unfinished``. Needs
``pip install 'rlasync[envs-frameworks]'``.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from ..config.endpoint import TRAIN_HEADER
from ..data import Row
from ..rewards import RewardOutput
from .base import EnvError, Environment, Split, import_extra, register_environment

MODEL = "policy"
SELF = "self"
"""``opponent: self``: the policy being trained plays the other seats."""
VAL_SEEDS = 1_000_000_007
"""Held-out games start from this seed (training games from 0): no training game is a held-out one."""


@register_environment("textarena")
class TextArena(Environment):
    """A TextArena game (see the module docstring)."""

    def __init__(
        self,
        *,
        seed: int,
        game: str,
        players: int = 1,
        player: int = 0,
        opponent: str | dict[str, Any] = "",
        size: int = 10000,
        max_turns: int = 30,
        unfinished: float = 0.0,
        system_prompt: str = "",
    ) -> None:
        where = "data.source.textarena"
        ta = import_extra(
            "textarena", setting="data.source.textarena", package="textarena", extra="envs-frameworks"
        )
        from textarena.envs.registration import ENV_REGISTRY

        if game not in ENV_REGISTRY:
            close = difflib.get_close_matches(game, list(ENV_REGISTRY), n=3)
            raise EnvError(
                f"{where}.game: TextArena has no game {game!r}"
                + (f" (did you mean {', '.join(close)}?)" if close else "")
            )
        if not 0 <= player < players:
            raise EnvError(f"{where}.player: {player} is not a seat of a {players}-player game")
        if players > 1 and not opponent:
            raise EnvError(
                f"{where}.opponent: {game} with {players} players needs an opponent: a function by import path "
                "(my_bots:first_free) or {url: ..., model: ...}"
            )
        self.ta, self.game, self.players, self.player = ta, game, players, player
        self.seed, self.size, self.max_turns, self.unfinished = int(seed), size, max_turns, unfinished
        self.system_prompt = system_prompt
        self._opponent = _opponent(opponent, where) if opponent else None
        self._opponent_client: Any = None

    async def open(self) -> None:
        if isinstance(self._opponent, dict):
            import openai

            self._opponent_client = openai.AsyncOpenAI(
                base_url=self._opponent["url"], api_key=self._opponent.get("api_key", "-")
            )

    async def close(self) -> None:
        if self._opponent_client is not None:
            await self._opponent_client.close()

    def rows(self, split: Split, n: int | None = None) -> list[Row]:
        n = self.size if n is None else n
        first = self.seed * 1_000_003 + (VAL_SEEDS if split == "val" else 0)
        return [
            {
                "messages": [{"role": "user", "content": f"TextArena {self.game}, game {first + i}"}],
                "uid": f"{self.game}:{split}:{i}",
                "agent_name": "environment",
                "textarena_seed": first + i,
                "kind": split,
            }
            for i in range(n)
        ]

    async def converse(self, client: Any, row: Row) -> RewardOutput:
        env = self.ta.make(self.game)
        env.reset(num_players=self.players, seed=int(row["textarena_seed"]))
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        ours = _Seat(messages)
        others: dict[int, _Seat] = {}  # self-play: each other seat's conversation
        aside = (
            client.with_options(default_headers={TRAIN_HEADER: "false"}) if self._opponent == SELF else None
        )
        turns, steps, done = 0, 0, False
        # The policy's turns are bounded by max_turns, everyone's moves (invalid ones retried,
        # other seats' included) by a multiple of it: no game holds its trajectory forever.
        while not done and turns < self.max_turns and steps < 4 * self.max_turns * self.players:
            steps += 1
            player, observation = env.get_observation()
            if player == self.player:
                move = await ours.move(client, observation)
                turns += 1
            elif aside is not None:
                seat = others.setdefault(player, _Seat(list(messages[:1]) if self.system_prompt else []))
                move = await seat.move(aside, observation)
            else:
                move = await self._move(observation, player)
            done, _ = env.step(move)
        rewards, _ = env.close()
        if not done or rewards is None:
            return RewardOutput(score=self.unfinished, metrics={"game_turns": float(turns), "finished": 0.0})
        return RewardOutput(
            score=float(rewards[self.player]), metrics={"game_turns": float(turns), "finished": 1.0}
        )

    async def _move(self, observation: str, player: int) -> str:
        opponent = self._opponent
        if callable(opponent):
            move = opponent(observation, player)
            return str(await move if inspect.isawaitable(move) else move)
        assert isinstance(opponent, dict) and self._opponent_client is not None
        reply = await self._opponent_client.chat.completions.create(
            model=opponent.get("model", "policy"), messages=[{"role": "user", "content": observation}]
        )
        return reply.choices[0].message.content or ""


class _Seat:
    """A seat the policy plays: its conversation, each new observation (what appeared since its
    last move) a user message and each reply the move."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages, self.seen = messages, ""

    async def move(self, client: Any, observation: str) -> str:
        new = observation[len(self.seen) :] if observation.startswith(self.seen) else observation
        self.seen = observation
        self.messages.append({"role": "user", "content": new.strip()})
        reply = await client.chat.completions.create(model=MODEL, messages=self.messages)
        move = reply.choices[0].message.content or ""
        self.messages.append({"role": "assistant", "content": move})
        return move


def _opponent(spec: str | dict[str, Any], where: str) -> Any:
    """A scripted opponent (a function by import path), a model's address, or ``self``."""
    if spec == SELF:
        return SELF
    from .. import plugins
    from ..config.loader import ConfigError, import_object

    if isinstance(spec, dict):
        unknown = set(spec) - {"url", "model", "api_key"}
        if "url" not in spec or unknown:
            raise EnvError(
                f"{where}.opponent: a model is {{url: ..., model: ..., api_key: ...}} (url required)"
                + (f"; unknown keys {sorted(unknown)}" if unknown else "")
            )
        return dict(spec)
    file, sep, name = spec.rpartition(":")
    try:
        if sep and plugins.is_file(file):  # path/to/bots.py:first_free, imported as a plugin file is
            found = getattr(plugins.load(file), name, None)
        else:
            found = import_object(spec, f"{where}.opponent", ConfigError)
    except ConfigError as exc:  # a PluginError too
        raise EnvError(f"{where}.opponent: {exc}") from None
    if not callable(found):
        raise EnvError(f"{where}.opponent={spec} is not a function of (observation, player id)")
    return found
