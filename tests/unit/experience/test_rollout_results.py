"""Final rows of a rollout's samples (``slot_rows``, ``grouped_slot_rows``): the columns each
sample's row gets from the state, per group of slots."""

from __future__ import annotations

import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.rollout_results import final_rows, grouped_slot_rows, slot_rows
from envloop.experience.rollout_state import RolloutState
from tests.fixtures.batches import make_batch


def finished_state(tokenizer) -> RolloutState:
    """Five echo samples, as if rolled out: rewards, turns, versions, one failed sample,
    a reward component reported by samples 1 and 3 only."""
    batch = make_batch(tokenizer, [{"task": "echo", "prompt": f"p{i}"} for i in range(5)])
    state = RolloutState.start(batch, tokenizer, max_seq_len=64)
    state.total_reward[:] = torch.tensor([0.5, 1.0, -1.0, 2.0, 0.0])
    state.turns[:] = torch.tensor([1, 2, 3, 1, 2])
    state.terminated[:] = torch.tensor([True, False, True, True, False])
    state.truncated[:] = torch.tensor([False, True, False, False, True])
    state.failed[2] = True
    state.errors[2] = "env said no"
    state.generation_failed[4] = True
    state.generation_errors[4] = "timed out"
    state.components["format"] = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    state.component_names[1].add("format")
    state.component_names[3].add("format")
    state.min_version[:] = torch.tensor([0, 1, -1, 2, 0])
    state.max_version[:] = torch.tensor([1, 1, -1, 3, 0])
    for i in range(5):
        state.turn_rewards[i].append(float(state.total_reward[i]))
    return state


def inputs(rows: list[int], loss_multiplier=None) -> BatchedDataDict:
    columns = {"idx": list(rows)}
    if loss_multiplier is not None:
        columns["loss_multiplier"] = loss_multiplier
    return BatchedDataDict(columns)


def same(a: BatchedDataDict, b: BatchedDataDict) -> None:
    assert list(a) == list(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_each_group_gets_the_rows_slot_rows_gives_it_alone(tiny_tokenizer):
    state = finished_state(tiny_tokenizer)
    groups = [[3, 1], [0], [4, 2]]
    for own in (False, True):
        together = grouped_slot_rows([inputs(g) for g in groups], state, groups, own)
        for group, rows in zip(groups, together):
            same(rows, slot_rows(inputs(group), state, group, own))


def test_grouped_rows_hold_the_states_values(tiny_tokenizer):
    state = finished_state(tiny_tokenizer)
    first, second = grouped_slot_rows(
        [inputs([3, 1]), inputs([4, 2])], state, [[3, 1], [4, 2]], own_components=True
    )
    assert first["total_reward"].tolist() == [2.0, 1.0]
    assert first["num_turns"].tolist() == [1, 2]
    assert first["loss_multiplier"].tolist() == [1.0, 1.0]
    assert first["format"].tolist() == [0.75, 0.25]
    assert first["reward_components"] == [["format"], ["format"]]
    assert (first["min_policy_version"].tolist(), first["max_policy_version"].tolist()) == (
        [2, 1],
        [3, 1],
    )
    # Neither sample of the second group reported the component: no column for it.
    assert "format" not in second
    assert second["loss_multiplier"].tolist() == [0.0, 0.0]  # generation and env failed
    assert second["env_error"] == [None, "env said no"]
    assert second["generation_error"] == ["timed out", None]
    assert second["truncated"].tolist() == [True, False]


def test_a_given_loss_multiplier_is_zeroed_where_a_sample_failed(tiny_tokenizer):
    state = finished_state(tiny_tokenizer)
    as_list, as_tensor = grouped_slot_rows(
        [inputs([1, 2], [0.5, 0.5]), inputs([4, 0], torch.tensor([2.0, 3.0]))],
        state,
        [[1, 2], [4, 0]],
    )
    assert as_list["loss_multiplier"] == [0.5, 0.0]
    assert as_tensor["loss_multiplier"].tolist() == [0.0, 3.0]


def test_a_groups_columns_do_not_change_when_its_slots_are_reused(tiny_tokenizer):
    state = finished_state(tiny_tokenizer)
    (rows,) = grouped_slot_rows([inputs([0, 1])], state, [[0, 1]])
    state.total_reward[:] = 9.0
    state.turns[:] = 9
    assert rows["total_reward"].tolist() == [0.5, 1.0]
    assert rows["num_turns"].tolist() == [1, 2]


def test_final_rows_keep_input_order_and_leave_the_input_batch_alone(tiny_tokenizer):
    state = finished_state(tiny_tokenizer)
    batch = inputs(list(range(5)))
    final = final_rows(batch, state)
    assert list(batch) == ["idx"]
    assert final["total_reward"].tolist() == [0.5, 1.0, -1.0, 2.0, 0.0]
    assert final["format"].tolist() == [0.0, 0.25, 0.0, 0.75, 0.0]
    assert final["loss_multiplier"].tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
    picked = final_rows(batch, state, [3, 0])
    assert picked["idx"] == [3, 0] and picked["total_reward"].tolist() == [2.0, 0.5]
