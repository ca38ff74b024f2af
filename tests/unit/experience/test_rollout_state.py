"""RolloutState and the turn-loop steps (docs/contract.md, "Rollout semantics") that update
it, on a scripted policy and in-process toy environments."""

from __future__ import annotations

import copy

import pytest
import torch

from envloop.data.chat_templates import ObservationRenderer
from envloop.environments.interfaces import EnvironmentReturn
from envloop.experience.env_dispatch import GroupResult
from envloop.experience.rollout_state import (
    RolloutState,
    append_observations,
    append_response_rows,
    append_responses,
    build_generation_input,
    record_rewards,
    update_episode_status,
)
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import guess_sample, make_batch
from tests.fixtures.envs import ComponentRewardEnv, EchoEnv, GuessNumberEnv


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(log) -> list[int]:
    return torch.cat([m["token_ids"] for m in log]).tolist()


def echo_batch(tokenizer, *prompts: str, **columns):
    batch = make_batch(tokenizer, [{"task": "echo", "prompt": p} for p in prompts])
    batch.update(columns)
    return batch


def take_generation(state, tokenizer, respond, active=None):
    """Steps 1 and 2 for ``active`` (default: every active sample) with a scripted policy."""
    active = state.active_indices() if active is None else active
    gen_input = build_generation_input(state, active)
    output = ScriptedGeneration(tokenizer, respond).generate(gen_input)
    return append_responses(state, active, gen_input, output, tokenizer)


def stepped(env, task, state, indices) -> GroupResult:
    """A group's step by an in-process environment, as the dispatcher reports it."""
    ret = env.step([state.env_views[i] for i in indices], [state.metadata[i] for i in indices])
    return GroupResult(task, indices, ret)


def observations(*contents: str, role: str = "user") -> EnvironmentReturn:
    n = len(contents)
    return EnvironmentReturn(
        [{"role": role, "content": c} for c in contents],
        [None] * n,
        [None] * n,
        torch.zeros(n),
        torch.zeros(n, dtype=torch.bool),
    )


# RolloutState.start


def test_start_lays_the_prompts_out_in_token_rows(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, [guess_sample(37), {"task": "echo", "prompt": "hi"}])
    state = RolloutState.start(batch, tiny_tokenizer, max_seq_len=64)
    ids, lengths = state.tokens.rows(torch.arange(2))
    assert lengths.tolist() == batch["length"]
    for row, n, log in zip(ids.tolist(), lengths.tolist(), batch["message_log"]):
        assert row[:n] == prompt_ids(log)
        assert row[n:] == [tiny_tokenizer.pad_token_id] * (max(lengths.tolist()) - n)
    assert state.size == 2 and state.active_indices().tolist() == [0, 1]


def test_start_gives_environments_role_and_content_only(tiny_tokenizer):
    state = RolloutState.start(echo_batch(tiny_tokenizer, "hi"), tiny_tokenizer, 64)
    assert state.env_views == [[{"role": "user", "content": "hi"}]]
    assert "token_ids" in state.message_logs[0][0]


def test_start_takes_metadata_stop_strings_and_task_names(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, [guess_sample(37), {"task": "echo", "prompt": "hi"}])
    state = RolloutState.start(batch, tiny_tokenizer, 64)
    assert state.metadata == [{"secret": 37, "guesses": 0, "max_guesses": 8}, None]
    assert state.stop_strings == [["</guess>"], None]
    assert state.task_names == ["guess", "echo"]


def test_start_zeroes_every_counter(tiny_tokenizer):
    state = RolloutState.start(echo_batch(tiny_tokenizer, "a", "b"), tiny_tokenizer, 64)
    assert state.total_reward.tolist() == [0.0, 0.0] and state.total_reward.dtype == torch.float32
    for counter in (state.turns, state.gen_tokens, state.env_tokens):
        assert counter.tolist() == [0, 0] and counter.dtype == torch.long
    assert state.done.tolist() == [False, False]
    assert state.turn_rewards == [[], []] and state.errors == [None, None]
    assert state.components == {} and state.component_names == [set(), set()]


def test_start_without_optional_columns(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a", "b")
    del batch["stop_strings"], batch["extra_env_info"]
    state = RolloutState.start(batch, tiny_tokenizer, 64)
    assert state.stop_strings == [None, None] and state.metadata == [None, None]


def test_start_shares_no_list_with_the_batch(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, [guess_sample(37)])
    state = RolloutState.start(batch, tiny_tokenizer, 64)
    state.message_logs[0].append({"role": "assistant", "content": "x"})
    state.metadata[0] = {"replaced": True}
    state.stop_strings[0] = None
    assert len(batch["message_log"][0]) == 1
    assert batch["extra_env_info"][0]["secret"] == 37
    assert batch["stop_strings"] == [["</guess>"]]


def test_a_prompt_of_exactly_max_seq_len_starts_truncated(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "hi", "a longer prompt")
    state = RolloutState.start(batch, tiny_tokenizer, max_seq_len=batch["length"][1])
    assert state.truncated.tolist() == [False, True]
    assert state.active_indices().tolist() == [0]


def test_start_of_an_empty_batch(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer)
    state = RolloutState.start(batch, tiny_tokenizer, 8)
    assert state.size == 0 and state.active_indices().tolist() == []
    assert tuple(state.tokens.ids.shape) == (0, 8)


def test_start_names_missing_columns(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a")
    del batch["task_name"]
    with pytest.raises(ValueError, match=r"lacks \['task_name'\]; a rollout batch needs"):
        RolloutState.start(batch, tiny_tokenizer, 64)


def test_start_rejects_fewer_task_names_than_logs(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a", "b", task_name=["echo"])
    with pytest.raises(ValueError, match=r"^The input batch has 2 message logs but 1 task names"):
        RolloutState.start(batch, tiny_tokenizer, 64)


def test_start_lists_every_prompt_longer_than_max_seq_len(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a", "b", "a much longer prompt than the others")
    limit = batch["length"][0] - 1
    with pytest.raises(ValueError) as info:
        RolloutState.start(batch, tiny_tokenizer, limit)
    lengths = batch["length"]
    assert str(info.value) == (
        f"max_seq_len={limit} is smaller than 3 prompt(s) (sample 0: {lengths[0]} tokens, "
        f"sample 1: {lengths[1]} tokens, sample 2: {lengths[2]} tokens). "
        "Raise max_seq_len or shorten those prompts."
    )


@pytest.mark.parametrize(
    ("stop_strings", "message"),
    [
        ([None], r"^'stop_strings' has 1 entries for 2 samples\.$"),
        ([None, "</call>"], r"^stop_strings\[1\] is '</call>'; each entry must be None or a list"),
        ([[""], None], r"^stop_strings\[0\] is \[''\]; each entry must be None or a list"),
    ],
)
def test_start_rejects_bad_stop_strings(tiny_tokenizer, stop_strings, message):
    batch = echo_batch(tiny_tokenizer, "a", "b", stop_strings=stop_strings)
    with pytest.raises(ValueError, match=message):
        RolloutState.start(batch, tiny_tokenizer, 64)


def test_start_rejects_extra_env_info_of_the_wrong_length(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a", "b", extra_env_info=[{"reply": "x"}])
    with pytest.raises(ValueError, match=r"'extra_env_info' has 1 entries for 2 samples; give"):
        RolloutState.start(batch, tiny_tokenizer, 64)


def test_start_requires_a_pad_token(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a")
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.pad_token = None
    with pytest.raises(ValueError, match=r"has no pad token; set one, e\.g\. tokenizer\.pad_token"):
        RolloutState.start(batch, tokenizer, 64)


def test_done_samples_are_not_active(tiny_tokenizer):
    state = RolloutState.start(echo_batch(tiny_tokenizer, *"abcde"), tiny_tokenizer, 64)
    state.terminated[0] = state.truncated[2] = state.failed[3] = True
    assert state.done.tolist() == [True, False, True, True, False]
    assert state.active_indices().tolist() == [1, 4]


# Step 1: build_generation_input


def test_generation_input_holds_the_active_rows_and_their_budgets(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, [guess_sample(37), {"task": "echo", "prompt": "a b c"}])
    state = RolloutState.start(batch, tiny_tokenizer, max_seq_len=40)
    gen_input = build_generation_input(state, torch.tensor([1, 0]))
    lengths = batch["length"]
    assert gen_input["input_lengths"].tolist() == [lengths[1], lengths[0]]
    assert gen_input["input_ids"].shape[1] == max(lengths)
    assert gen_input["input_ids"][0, : lengths[1]].tolist() == prompt_ids(batch["message_log"][1])
    assert gen_input["stop_strings"] == [None, ["</guess>"]]
    assert gen_input["max_new_tokens"].tolist() == [40 - lengths[1], 40 - lengths[0]]


# Step 2: append_responses


def test_responses_are_appended_with_their_exact_tokens(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a", "b", stop_strings=[None, ["!"]])
    state = RolloutState.start(batch, tiny_tokenizer, 64)
    responses = take_generation(state, tiny_tokenizer, lambda prompt: "ok! more")
    eos = tiny_tokenizer.eos_token_id
    first, second = state.message_logs[0][-1], state.message_logs[1][-1]
    assert (first["content"], second["content"]) == ("ok! more", "ok!")
    assert first["token_ids"].tolist() == [*encode(tiny_tokenizer, "ok! more"), eos]
    assert second["token_ids"].tolist() == encode(tiny_tokenizer, "ok!")  # stopped: no EOS
    assert first["generation_logprobs"].tolist() == [-1.0] * len(first["token_ids"])
    assert state.env_views[1][-1] == {"role": "assistant", "content": "ok!"}
    assert responses.ended_with_eos == [True, False]


def test_responses_extend_token_rows_and_counters_of_active_samples_only(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a", "b")
    state = RolloutState.start(batch, tiny_tokenizer, 64)
    take_generation(state, tiny_tokenizer, lambda prompt: "ok", active=torch.tensor([1]))
    n = len(encode(tiny_tokenizer, "ok")) + 1
    assert state.tokens.lengths.tolist() == [batch["length"][0], batch["length"][1] + n]
    row = state.tokens.rows(torch.tensor([1]))[0][0].tolist()
    assert row == prompt_ids(state.message_logs[1])
    assert state.turns.tolist() == [0, 1] and state.gen_tokens.tolist() == [0, n]
    assert len(state.message_logs[0]) == 1


def test_a_response_past_its_budget_is_cut_to_max_seq_len(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a")
    state = RolloutState.start(batch, tiny_tokenizer, batch["length"][0] + 3)
    active = state.active_indices()
    gen_input = build_generation_input(state, active)
    unbounded = {k: v for k, v in gen_input.items() if k != "max_new_tokens"}
    output = ScriptedGeneration(tiny_tokenizer, lambda p: "hello world").generate(unbounded)
    append_responses(state, active, gen_input, output, tiny_tokenizer)
    assert state.message_logs[0][-1]["token_ids"].tolist() == encode(tiny_tokenizer, "hello")[:3]
    assert state.tokens.lengths.tolist() == [batch["length"][0] + 3]


def test_append_responses_rejects_an_output_with_too_few_rows(tiny_tokenizer):
    state = RolloutState.start(echo_batch(tiny_tokenizer, "a", "b"), tiny_tokenizer, 64)
    active = state.active_indices()
    gen_input = build_generation_input(state, active)
    output = ScriptedGeneration(tiny_tokenizer, lambda p: "ok").generate(gen_input.slice(0, 1))
    with pytest.raises(ValueError, match=r"returned 1 rows of 'output_ids' for 2 prompts"):
        append_responses(state, active, gen_input, output, tiny_tokenizer)


def test_responses_that_came_back_one_at_a_time_are_appended_as_their_batch_would_be(
    tiny_tokenizer,
):
    batch = echo_batch(tiny_tokenizer, "a", "b", "c", stop_strings=[None, ["!"], None])
    batched, one_by_one = (RolloutState.start(batch, tiny_tokenizer, 64) for _ in range(2))
    active = torch.tensor([2, 0, 1])
    gen_input = build_generation_input(batched, active)
    policy = ScriptedGeneration(tiny_tokenizer, lambda prompt: "ok! more")
    policy.update_weights(policy.respond, version=4)
    output = policy.generate(gen_input)
    output["generation_error"] = [None, "out of memory", None]
    expected = append_responses(batched, active, gen_input, output, tiny_tokenizer)
    got = append_response_rows(
        one_by_one, active.tolist(), gen_input["input_lengths"].tolist(),
        gen_input["max_new_tokens"].tolist(), [output.slice(j, j + 1) for j in range(3)],
        tiny_tokenizer,
    )  # fmt: skip
    assert got.texts == expected.texts and got.errors == expected.errors
    for a, b in zip(one_by_one.message_logs, batched.message_logs, strict=True):
        assert [m.keys() for m in a] == [m.keys() for m in b]
        for got_message, message in zip(a, b):
            for key, value in message.items():
                same = torch.equal if isinstance(value, torch.Tensor) else (lambda x, y: x == y)
                assert same(got_message[key], value), key
    assert one_by_one.env_views == batched.env_views
    assert one_by_one.generation_errors == batched.generation_errors == [
        "generation failed: out of memory", None, None,
    ]  # fmt: skip
    for name in ("generation_failed", "turns", "gen_tokens", "min_version", "max_version"):
        assert torch.equal(getattr(one_by_one, name), getattr(batched, name)), name
    assert one_by_one.min_version.tolist() == [-1, 4, 4]
    assert torch.equal(one_by_one.tokens.ids, batched.tokens.ids)
    assert torch.equal(one_by_one.tokens.lengths, batched.tokens.lengths)


# Step 4: record_rewards


def test_scalar_rewards_add_up_over_turns(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, [guess_sample(50), guess_sample(25)])
    state = RolloutState.start(batch, tiny_tokenizer, 256)
    env = GuessNumberEnv()
    for guess in ("<guess>25</guess>", "<guess>50</guess>"):
        take_generation(state, tiny_tokenizer, lambda prompt, g=guess: g)
        record_rewards(state, [stepped(env, "guess", state, [0, 1])])
    assert state.turn_rewards == [[0.0, 1.0], [1.0, 0.0]]
    assert state.total_reward.tolist() == [1.0, 1.0]
    assert state.components == {}


def test_dict_rewards_keep_each_component_and_sum_into_the_total(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a", "b", "c", task_name=["parts", "echo", "parts"])
    state = RolloutState.start(batch, tiny_tokenizer, 64)
    take_generation(state, tiny_tokenizer, lambda prompt: "four")
    results = [
        stepped(ComponentRewardEnv(), "parts", state, [0, 2]),
        stepped(EchoEnv(), "echo", state, [1]),
    ]
    record_rewards(state, results)
    assert state.components["reward/format"].tolist() == [0.25, 0.0, 0.25]
    assert state.components["reward/length"].tolist() == pytest.approx([0.04, 0.0, 0.04])
    assert state.total_reward.tolist() == pytest.approx([0.29, 0.5, 0.29])
    parts = {"reward/format", "reward/length"}
    assert state.component_names == [parts, set(), parts]


def test_a_failed_group_fails_its_samples_with_a_zero_turn_reward(tiny_tokenizer):
    state = RolloutState.start(echo_batch(tiny_tokenizer, "a", "b", "c"), tiny_tokenizer, 64)
    take_generation(state, tiny_tokenizer, lambda prompt: "ok")
    results = [
        GroupResult("bad", [0, 2], error="env bad.step timed out after 1 s"),
        stepped(EchoEnv(), "echo", state, [1]),
    ]
    record_rewards(state, results)
    assert state.failed.tolist() == [True, False, True]
    timed_out = "env bad.step timed out after 1 s"
    assert state.errors == [timed_out, None, timed_out]
    assert state.turn_rewards == [[0.0], [0.5], [0.0]]
    assert state.total_reward.tolist() == [0.0, 0.5, 0.0]
    assert state.active_indices().tolist() == [1]


def test_a_failed_group_without_error_text_gets_a_generic_one(tiny_tokenizer):
    state = RolloutState.start(echo_batch(tiny_tokenizer, "a"), tiny_tokenizer, 64)
    record_rewards(state, [GroupResult("echo", [0])])
    assert state.errors == ["environment step failed"] and state.failed.tolist() == [True]


# Step 5: append_observations


def test_raw_observations_are_tokenized_as_is(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a", "b")
    state = RolloutState.start(batch, tiny_tokenizer, 128)
    responses = take_generation(state, tiny_tokenizer, lambda prompt: "ok")
    eos_flags = dict(enumerate(responses.ended_with_eos))
    results = [GroupResult("echo", [1, 0], observations("<result>7</result>", " again\n"))]
    append_observations(state, results, eos_flags, tiny_tokenizer, None)
    assert state.message_logs[0][-1]["content"] == " again\n"
    assert state.message_logs[0][-1]["token_ids"].tolist() == encode(tiny_tokenizer, " again\n")
    assert state.message_logs[1][-1]["token_ids"].tolist() == encode(
        tiny_tokenizer, "<result>7</result>"
    )
    assert state.env_views[1][-1] == {"role": "user", "content": "<result>7</result>"}
    for i in (0, 1):
        row, length = state.tokens.rows(torch.tensor([i]))
        assert row[0, : length[0]].tolist() == prompt_ids(state.message_logs[i])
    expected_env = [len(encode(tiny_tokenizer, t)) for t in (" again\n", "<result>7</result>")]
    assert state.env_tokens.tolist() == expected_env
    assert state.truncated.tolist() == [False, False]


def test_failed_groups_get_no_observation(tiny_tokenizer):
    state = RolloutState.start(echo_batch(tiny_tokenizer, "a", "b"), tiny_tokenizer, 128)
    take_generation(state, tiny_tokenizer, lambda prompt: "ok")
    results = [GroupResult("bad", [0], error="boom"), GroupResult("echo", [1], observations("x"))]
    append_observations(state, results, {0: True, 1: True}, tiny_tokenizer, None)
    assert [m["role"] for m in state.message_logs[0]] == ["user", "assistant"]
    assert [m["role"] for m in state.message_logs[1]] == ["user", "assistant", "user"]
    assert state.env_tokens.tolist() == [0, 1]


def test_chat_template_observations_make_the_templated_conversation(chat_tokenizer):
    batch = echo_batch(chat_tokenizer, "hi", "go", stop_strings=[None, ["!"]])
    state = RolloutState.start(batch, chat_tokenizer, 256)
    responses = take_generation(state, chat_tokenizer, lambda prompt: "ok! more")
    assert responses.ended_with_eos == [True, False]
    results = [GroupResult("echo", [0, 1], observations("again", "<result>7</result>"))]
    renderer = ObservationRenderer(chat_tokenizer)
    append_observations(state, results, {0: True, 1: False}, chat_tokenizer, renderer)
    for log in state.message_logs:
        conversation = [{"role": m["role"], "content": m["content"]} for m in log]
        expected = chat_tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=True
        )["input_ids"]
        assert prompt_ids(log) == expected
    assert [log[-1]["content"] for log in state.message_logs] == ["again", "<result>7</result>"]


def test_an_observation_past_max_seq_len_is_cut_to_fit(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a")
    response = len(encode(tiny_tokenizer, "ok")) + 1
    max_seq_len = batch["length"][0] + response + 3
    state = RolloutState.start(batch, tiny_tokenizer, max_seq_len)
    take_generation(state, tiny_tokenizer, lambda prompt: "ok")
    text = "The quick brown fox"
    append_observations(
        state, [GroupResult("echo", [0], observations(text))], {0: True}, tiny_tokenizer, None
    )
    cut = state.message_logs[0][-1]
    assert cut["token_ids"].tolist() == encode(tiny_tokenizer, text)[:3]
    assert cut["content"] == tiny_tokenizer.decode(cut["token_ids"].tolist())
    assert state.env_views[0][-1]["content"] == cut["content"]
    assert state.tokens.lengths.tolist() == [max_seq_len]
    assert state.truncated.tolist() == [True] and state.env_tokens.tolist() == [3]


def test_a_cut_chat_template_observation_keeps_only_its_own_text_as_content(chat_tokenizer):
    renderer = ObservationRenderer(chat_tokenizer)
    text = "The quick brown fox jumps over the lazy dog"
    rendered = renderer.render("user", text, response_ended_with_eos=True)
    full = encode(chat_tokenizer, rendered)
    head = len(encode(chat_tokenizer, rendered[: rendered.index(text)]))  # the turn's markup
    keep = head + 3  # the markup and a few tokens of the text
    batch = echo_batch(chat_tokenizer, "a")
    response = len(encode(chat_tokenizer, "ok")) + 1  # and EOS
    state = RolloutState.start(batch, chat_tokenizer, batch["length"][0] + response + keep)
    assert take_generation(state, chat_tokenizer, lambda prompt: "ok").ended_with_eos == [True]
    append_observations(
        state, [GroupResult("echo", [0], observations(text))], {0: True}, chat_tokenizer, renderer
    )
    cut = state.message_logs[0][-1]
    assert cut["token_ids"].tolist() == full[:keep] and state.truncated.tolist() == [True]
    kept_text = chat_tokenizer.decode(full[:keep])
    assert cut["content"] == kept_text[rendered.index(text) :]  # no template markup
    assert text.startswith(cut["content"]) and 0 < len(cut["content"]) < len(text)
    assert state.env_views[0][-1]["content"] == cut["content"]


def test_an_observation_that_just_fills_max_seq_len_is_kept_whole_and_truncates(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a")
    response = len(encode(tiny_tokenizer, "ok")) + 1
    obs = encode(tiny_tokenizer, "again")
    state = RolloutState.start(batch, tiny_tokenizer, batch["length"][0] + response + len(obs))
    take_generation(state, tiny_tokenizer, lambda prompt: "ok")
    append_observations(
        state, [GroupResult("echo", [0], observations("again"))], {0: True}, tiny_tokenizer, None
    )
    assert state.message_logs[0][-1]["content"] == "again"
    assert state.message_logs[0][-1]["token_ids"].tolist() == obs
    assert state.truncated.tolist() == [True]


def test_no_observation_message_when_none_of_it_fits(tiny_tokenizer):
    batch = echo_batch(tiny_tokenizer, "a")
    state = RolloutState.start(batch, tiny_tokenizer, batch["length"][0] + 2)
    take_generation(state, tiny_tokenizer, lambda prompt: "hello")  # cut to 2 tokens
    append_observations(
        state, [GroupResult("echo", [0], observations("again"))], {0: False}, tiny_tokenizer, None
    )
    assert [m["role"] for m in state.message_logs[0]] == ["user", "assistant"]
    assert [m["role"] for m in state.env_views[0]] == ["user", "assistant"]
    assert state.truncated.tolist() == [True] and state.env_tokens.tolist() == [0]


def test_an_empty_observation_that_fits_is_still_appended(tiny_tokenizer):
    state = RolloutState.start(echo_batch(tiny_tokenizer, "a"), tiny_tokenizer, 64)
    take_generation(state, tiny_tokenizer, lambda prompt: "ok")
    append_observations(
        state, [GroupResult("echo", [0], observations(""))], {0: True}, tiny_tokenizer, None
    )
    assert state.env_views[0][-1] == {"role": "user", "content": ""}
    assert state.message_logs[0][-1]["token_ids"].tolist() == []


# Step 6: update_episode_status


def test_episode_status_takes_metadata_stop_strings_and_terminations(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, [guess_sample(50), guess_sample(25), guess_sample(75)])
    state = RolloutState.start(batch, tiny_tokenizer, 256)
    take_generation(state, tiny_tokenizer, lambda prompt: "<guess>50</guess>")
    result = stepped(GuessNumberEnv(), "guess", state, [0, 1, 2])
    update_episode_status(state, [result])
    assert state.terminated.tolist() == [True, False, False]
    assert [md["guesses"] for md in state.metadata] == [1, 1, 1]
    assert state.stop_strings == [["</guess>"]] * 3


def test_none_metadata_keeps_the_last_and_none_stop_strings_clear_them(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, [guess_sample(50), guess_sample(25)])
    state = RolloutState.start(batch, tiny_tokenizer, 256)
    take_generation(state, tiny_tokenizer, lambda prompt: "ok")
    ended = observations("done")._replace(
        metadata=[None], terminateds=torch.tensor([True]), next_stop_strings=[None]
    )
    results = [GroupResult("guess", [1], ended), GroupResult("bad", [0], error="boom")]
    update_episode_status(state, results)
    assert state.metadata == batch["extra_env_info"]  # None: unchanged
    assert state.stop_strings == [["</guess>"], None]  # the failed group's are untouched
    assert state.terminated.tolist() == [False, True]
