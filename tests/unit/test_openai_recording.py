"""How recorded calls become samples (``rlasync.serving.recording``), and how a trajectory's
further samples train with its advantage (``Run.train_batch``)."""

from __future__ import annotations

from rlasync.engines import SamplingParams
from rlasync.serving import Call, Recording, samples, trajectory_of


def call(prompt: list[int], completion: list[int], finish: str = "stop") -> Call:
    return Call(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.5] * len(completion),
        versions=[3] * len(completion),
        finish_reason=finish,
    )


def test_a_call_that_continues_another_token_for_token_extends_its_sample() -> None:
    first = call([1, 2], [3, 4])
    second = call([1, 2, 3, 4, 9, 9], [5])  # 9 9: the tool's reply and the template's separators
    third = call([1, 2, 3, 4, 9, 9, 5, 8], [6, 7], finish="length")
    assert samples([first, second, third]) == [[first, second, third]]
    t = trajectory_of([first, second, third], response_length=100)
    assert t.prompt_ids == [1, 2]
    assert t.response_ids == [3, 4, 9, 9, 5, 8, 6, 7]
    assert t.response_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert t.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, 0.0, -0.5, -0.5]
    assert t.versions == [3, 3, -1, -1, 3, -1, 3, 3]
    assert t.termination == "max_new_tokens" and t.num_turns == 6


def test_edited_history_and_parallel_choices_are_samples_of_their_own() -> None:
    a = call([1, 2], [3, 4])
    b = call([1, 2], [3, 5])  # a second choice of the same prompt (n=2)
    after_b = call([1, 2, 3, 5, 9], [6])
    edited = call([1, 7, 3, 4, 9], [6])  # the client rewrote an earlier turn
    groups = samples([a, b, after_b, edited])
    assert groups == [[a], [b, after_b], [edited]]


def test_the_longest_continued_sample_wins_and_the_budget_cuts() -> None:
    short = call([1], [2])
    longer = call([1, 2, 9], [3])
    again = call([1, 2, 9, 3, 9], [4, 4, 4])
    assert samples([short, longer, again]) == [[short, longer, again]]
    t = trajectory_of([short, longer, again], response_length=5)
    assert len(t.response_ids) == 5 and t.termination == "response_length"


def test_a_conversation_sent_back_is_found_and_an_edited_one_is_not() -> None:
    rec = Recording("key", SamplingParams(), "traj-1")
    asked = [{"role": "user", "content": "What is 6*7?"}]
    reply = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "6*7"}'}}
        ],
    }
    rec.remember([*asked, reply], None, [1, 2, 3])
    tool = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    # The client re-serialises the arguments and sends content "" for null: still the same turn.
    echoed = dict(
        reply, content="", tool_calls=[{"id": "c1", "function": {"name": "calc", "arguments": '{"e":"6*7"}'}}]
    )
    assert rec.continued([*asked, echoed, tool], None) == ([1, 2, 3], [tool])
    assert rec.continued([*asked, dict(reply, content="I think"), tool], None) is None  # edited
    assert rec.continued([*asked, reply, tool], [{"type": "function"}]) is None  # other tools
    assert rec.continued([*asked, reply], None) is None  # nothing new after it


def test_further_samples_train_with_their_trajectorys_advantage() -> None:
    import torch

    from rlasync.compose.batch import with_samples

    a, b = (
        trajectory_of([call([1], [2])], response_length=8),
        trajectory_of([call([1], [3])], response_length=8),
    )
    extra = trajectory_of([call([4], [5])], response_length=8)
    b.samples = [extra]
    flat, advantages = with_samples([a, b], torch.tensor([0.5, -0.5]))
    assert flat == [a, b, extra]
    assert advantages.tolist() == [0.5, -0.5, -0.5]
