"""Reward functions: exact scores on crafted responses, lookup errors, and weighted mixes."""

from __future__ import annotations

import pytest

from envloop.config.errors import ConfigError
from envloop.environments.rewards import (
    RewardOutcome,
    bbox_giou,
    close_math_verifiers,
    combine_rewards,
    exact_alnum,
    format_reward,
    get_reward_function,
    iou_and_giou,
    math_expr,
    parse_box,
    reward_config_problems,
)
from tests.fixtures import custom_rewards

CUSTOM = "tests.fixtures.custom_rewards"
MATH = {"timeout_s": 3.0, "processes": 2}  # one shared pair of math-verify processes


@pytest.fixture(scope="module", autouse=True)
def _stop_math_processes():
    yield
    close_math_verifiers()


def test_format_gives_half_credit_per_tag_pair():
    responses = [
        "<think>look</think><answer>B</answer>",
        "<answer>B</answer>",
        "<think>look</think> B",
        "<think>look <answer>B",  # unclosed tags
        "</answer>B<answer>",  # closing before opening
        "",
    ]
    assert format_reward(responses, [None] * 6) == [
        (1.0, None), (0.5, None), (0.5, None), (0.0, None), (0.0, None), (0.0, None),
    ]  # fmt: skip


def test_format_tags_are_configurable():
    scores = format_reward(
        ["<reason>x</reason><final>B</final>", "<think>x</think><answer>B</answer>"],
        [None, None],
        think_tag="reason",
        answer_tag="final",
    )
    assert scores == [(1.0, None), (0.0, None)]


def test_exact_alnum_keeps_only_letters_and_digits_case_insensitively():
    cases = [
        ("<answer> (B). </answer>", "b", True),
        ("<answer>Forty-Two</answer>", "forty two", True),
        ("<answer>3.14</answer>", "314", True),  # the dot is dropped too
        ("<answer>Café</answer>", "CAFÉ", True),  # unicode letters count
        ("<answer>A</answer> or <answer>C</answer>", "c", True),  # the last tag wins
        ("b.", "B", True),  # no tag: the whole response is the answer
        ("The answer is b", "B", False),
        ("<answer>?!</answer>", "", False),  # nothing left: never correct
        ("<answer>B</answer>", "C", False),
    ]
    responses, truths, expected = zip(*cases)
    scores = exact_alnum(list(responses), list(truths))
    assert scores == [(float(e), e) for e in expected]


def test_exact_alnum_answer_tag_is_configurable():
    assert exact_alnum(
        ["<final>x1</final>", "<answer>x1</answer>"], ["X1"] * 2, answer_tag="final"
    ) == [
        (1.0, True),
        (0.0, False),
    ]


@pytest.mark.slow
def test_math_expr_uses_real_math_verify_equivalence():
    cases = [
        ("<answer>\\frac{1}{2}</answer>", "0.5", True),
        ("<answer>(x+1)^2</answer>", "x^2+2x+1", True),
        ("<answer>\\sqrt{2}/2</answer>", "\\frac{\\sqrt{2}}{2}", True),
        ("<answer>\\boxed{3}</answer>", "3", True),
        ("so the result is \\boxed{12}", "12", True),  # untagged: free text
        ("<answer>4</answer>", "3", False),
        ("<answer>}}{{\\frac</answer>", "3", False),  # garbage
        ("", "3", False),
    ]
    responses, truths, expected = zip(*cases)
    scores = math_expr(list(responses), list(truths), **MATH)
    assert scores == [(float(e), e) for e in expected]


@pytest.mark.slow
def test_math_expr_times_out_a_pathological_answer_and_goes_on():
    responses = ["<answer>9^{9^{9^{9}}}</answer>", "<answer>\\frac{3}{4}</answer>"]
    scores = math_expr(responses, ["1", "0.75"], **MATH)
    assert scores == [(0.0, False), (1.0, True)]
    # The replaced worker process is warmed up again and serves the next batch.
    assert math_expr(["<answer>0.75</answer>"] * 2, ["3/4"] * 2, **MATH) == [
        (1.0, True),
        (1.0, True),
    ]


def test_giou_on_known_boxes():
    assert iou_and_giou([0, 0, 2, 2], [0, 0, 2, 2]) == (1.0, 1.0)
    iou, giou = iou_and_giou([0, 0, 2, 2], [1, 1, 3, 3])  # overlap 1, union 7, hull 9
    assert iou == pytest.approx(1 / 7) and giou == pytest.approx(1 / 7 - 2 / 9)
    assert iou_and_giou([0, 0, 1, 1], [2, 0, 3, 1]) == (0.0, pytest.approx(-1 / 3))  # apart
    assert iou_and_giou([0, 0, 4, 4], [1, 1, 3, 3]) == (0.25, 0.25)  # enclosing: hull = union


def test_bbox_giou_scores_map_giou_to_unit_range():
    truth = [1, 1, 3, 3]
    responses = [
        "<answer>[1, 1, 3, 3]</answer>",  # identical
        "<answer>[0, 0, 4, 4]</answer>",  # encloses: IoU 0.25
        "<answer>[2, 2, 4, 4]</answer>",  # overlaps: IoU 1/7
        "<answer>[5, 1, 7, 3]</answer>",  # apart: IoU 0, hull 12, union 8
        "box: [1.0,1.0,3.0,3.0]",  # untagged, floats, no spaces
    ]
    scores = bbox_giou(responses, [truth] * 5)
    assert [correct for _, correct in scores] == [True, False, False, False, True]
    assert [s for s, _ in scores] == pytest.approx(
        [1.0, 0.625, (1 / 7 - 2 / 9 + 1) / 2, (-4 / 12 + 1) / 2, 1.0]
    )


def test_bbox_giou_threshold_and_text_ground_truth():
    scores = bbox_giou(["[0, 0, 4, 4]"] * 2, ["[1, 1, 3, 3]", (1, 1, 3, 3)], iou_threshold=0.25)
    assert scores == [(0.625, True), (0.625, True)]


def test_malformed_boxes_score_zero():
    responses = [
        "<answer>[1, 2, 3]</answer>",  # three numbers
        "<answer>[3, 3, 1, 1]</answer>",  # corners swapped
        "<answer>[1, 1, 1, 3]</answer>",  # zero width
        "<answer>[a, b, c, d]</answer>",
        "<answer>the cat</answer>",
        "",
    ]
    assert bbox_giou(responses, [[1, 1, 3, 3]] * 6) == [(0.0, False)] * 6
    assert parse_box("[1e1, -2, 2e1, .5]") == (10.0, -2.0, 20.0, 0.5)


def test_bbox_giou_rejects_a_bad_ground_truth():
    with pytest.raises(ValueError, match=r"ground truth 'cat' is not a box"):
        bbox_giou(["[1, 1, 3, 3]"], ["cat"])


def test_lookup_by_name_and_by_import_path():
    assert get_reward_function("math_expr") is math_expr
    assert get_reward_function(f"{CUSTOM}:starts_with_truth") is custom_rewards.starts_with_truth


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("exact_alum", "No reward function named 'exact_alum'. Known: bbox_giou, exact_alnum, "
         "format, math_expr. Did you mean 'exact_alnum'?"),
        ("mypkg.rewards.my_reward", "lacks ':'. Custom functions go by import path"),
        ("no_such_pkg.rewards:fn", "cannot import module 'no_such_pkg.rewards'"),
        (f"{CUSTOM}:nope", f"{CUSTOM} has no function 'nope'"),
        (f"{CUSTOM}:NOT_A_FUNCTION", f"{CUSTOM} has no function 'NOT_A_FUNCTION'"),
    ],
)  # fmt: skip
def test_lookup_errors_explain_the_fix(name, message):
    with pytest.raises((ValueError, ImportError)) as info:
        get_reward_function(name)
    assert message in str(info.value)


def test_weights_are_normalized():
    responses = ["<think>.</think><answer>b</answer>", "<answer>c</answer>", "b"]
    mix = [{"name": "format", "weight": 2}, {"name": "exact_alnum", "weight": 6}]
    assert combine_rewards(mix, responses, ["B"] * 3) == [
        RewardOutcome(1.0, True, []),
        RewardOutcome(0.125, False, []),  # 0.25 * 0.5 + 0.75 * 0
        RewardOutcome(0.75, True, []),
    ]
    scaled = [{**m, "weight": m["weight"] / 8} for m in mix]
    assert combine_rewards(scaled, responses, ["B"] * 3) == combine_rewards(
        mix, responses, ["B"] * 3
    )


def test_correct_only_when_every_judging_function_agrees():
    mix = [
        {"name": "exact_alnum", "weight": 1},
        {"name": f"{CUSTOM}:starts_with_truth", "weight": 1, "kwargs": {"ignore_case": True}},
        {"name": "format", "weight": 2},
    ]
    outcomes = combine_rewards(mix, ["b", "<answer>b</answer>"], ["B", "B"])
    assert outcomes == [RewardOutcome(0.5, True, []), RewardOutcome(0.5, False, [])]
    assert combine_rewards([{"name": "format", "weight": 1}], ["x"], [None])[0].correct is None


def test_custom_bare_scores_mean_no_verdict():
    mix = [{"name": f"{CUSTOM}:length_share", "weight": 1, "kwargs": {"target": 4}}]
    assert combine_rewards(mix, ["ab", "abcdef"], [None, None]) == [
        RewardOutcome(0.5, None, []),
        RewardOutcome(1.0, None, []),
    ]


def test_a_raising_function_scores_zero_only_where_it_fails():
    mix = [
        {"name": "exact_alnum", "weight": 1},
        {"name": f"{CUSTOM}:explodes_on_boom", "weight": 1},
    ]
    outcomes = combine_rewards(mix, ["a", "boom", "c"], ["a", "boom", "x"])
    assert outcomes == [
        RewardOutcome(1.0, True, []),
        RewardOutcome(
            0.5,
            False,
            [f"{CUSTOM}:explodes_on_boom: RuntimeError: cannot score 'boom'"],
        ),
        RewardOutcome(0.5, False, []),
    ]


@pytest.mark.parametrize(
    ("fn", "error"),
    [
        ("out_of_range", "returned (1.5, True); expected (score in [0, 1], bool or None)"),
        ("no_scores", "returned 0 scores for 1 responses"),
    ],
)
def test_bad_return_values_are_errors_not_scores(fn, error):
    outcomes = combine_rewards([{"name": f"{CUSTOM}:{fn}", "weight": 1}], ["long answer"], ["x"])
    assert outcomes == [RewardOutcome(0.0, False, [f"{CUSTOM}:{fn}: ValueError: {error}"])]


def test_a_bad_ground_truth_is_reported_per_sample():
    outcomes = combine_rewards(
        [{"name": "bbox_giou", "weight": 1}], ["[0, 0, 2, 2]"] * 2, [[0, 0, 2, 2], "cat"]
    )
    assert outcomes[0] == RewardOutcome(1.0, True, [])
    assert outcomes[1].score == 0.0 and outcomes[1].correct is False
    assert outcomes[1].errors == [
        "bbox_giou: ValueError: ground truth 'cat' is not a box [x1, y1, x2, y2] with x1<x2, y1<y2"
    ]


def test_config_problems_are_all_listed():
    problems = reward_config_problems(
        [
            {"name": "fromat", "weight": 1},
            {"name": "exact_alnum", "weight": 0},
            {"name": "format", "weight": -1, "kwargs": {"think_tag": 3, "answer_tg": "a"}},
            {"weight": 1},
            {"name": "math_expr", "weight": "heavy", "kwargs": []},
            {"name": "no.module:fn", "weight": 1},
            {"name": f"{CUSTOM}:length_share", "weight": 1, "kwargs": {"target": 4, "other": 1}},
            "format",
        ]
    )
    assert problems[0].startswith("reward_functions[0].name: No reward function named 'fromat'")
    assert "Did you mean 'format'?" in problems[0]
    assert problems[1:7] == [
        "reward_functions[1].weight: must be > 0, got 0",
        "reward_functions[2].weight: must be > 0, got -1",
        "reward_functions[2].kwargs.think_tag: expected str, got int (3)",
        "reward_functions[2].kwargs.answer_tg: unknown option. Did you mean 'answer_tag'?",
        "reward_functions[3].name: required",
        "reward_functions[4].weight: expected number, got str ('heavy')",
    ]
    assert problems[7] == "reward_functions[4].kwargs: expected dict, got list ([])"
    assert problems[8].startswith("reward_functions[5].name: Reward function 'no.module:fn': ")
    assert problems[9:] == [  # entry 6's function takes **kwargs: any key
        "reward_functions[7]: expected a mapping, got str ('format')"
    ]


def test_config_problems_of_a_missing_list():
    expected = [
        "reward_functions: expected a non-empty list of {'name', 'weight', 'kwargs'?} dicts"
    ]
    assert reward_config_problems([]) == expected
    assert reward_config_problems(None) == expected


def test_combine_rejects_a_bad_mix_with_every_problem():
    with pytest.raises(ConfigError) as info:
        combine_rewards([{"name": "format"}, {"name": "exact_alnum", "weight": 0}], ["x"], ["x"])
    assert info.value.problems == [
        "reward_functions[0].weight: required",
        "reward_functions[1].weight: must be > 0, got 0",
    ]


def test_a_function_that_cannot_take_the_batch_is_a_config_problem():
    problems = reward_config_problems([{"name": "builtins:len", "weight": 1}])
    assert len(problems) == 1
    assert problems[0].startswith("reward_functions[0].kwargs: cannot call it as fn(responses, ")
