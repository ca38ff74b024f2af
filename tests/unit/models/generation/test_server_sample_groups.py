"""Which rows ``ServerGeneration`` sends together as one request for several completions
(``server_generation._same_prompt``): a prompt's samples (same text prompt, budget and stop
strings, consecutive seeds). That each row then gets the tokens of a request of its own is
tested against a real llama-server (``tests/integration/test_server_generation.py``; this
file is not named after its module because that one is)."""

from __future__ import annotations

import pytest

from envloop.models.generation.server_dialects import GenerationRequest
from envloop.models.generation.server_generation import _listed, _same_prompt
from envloop.models.generation.server_media import RequestImages

FIRST = GenerationRequest([5, 6, 7], 8, ["</a>"], 40)


@pytest.mark.parametrize(
    ("request_", "j", "joins"),
    [
        (GenerationRequest([5, 6, 7], 8, ["</a>"], 42), 2, True),
        (GenerationRequest([5, 6, 7], 8, ["</a>"], 41), 2, False),  # seed not first + j
        (GenerationRequest([5, 6, 8], 8, ["</a>"], 41), 1, False),  # another prompt
        (GenerationRequest([5, 6, 7], 9, ["</a>"], 41), 1, False),  # another budget
        (GenerationRequest([5, 6, 7], 8, None, 41), 1, False),  # other stop strings
        (GenerationRequest([5, 6, 7], 8, ["</a>"], None), 1, False),  # unseeded
    ],
)
def test_a_row_joins_the_group_only_as_its_next_sample(request_, j, joins):
    assert _same_prompt(FIRST, request_, j) is joins


def test_unseeded_samples_group_and_rows_with_images_never_do():
    unseeded = GenerationRequest([5, 6, 7], 8, None, None)
    assert _same_prompt(unseeded, unseeded, 3)
    images = RequestImages(png=(b"\x89PNG",), spans=((0, 1),))
    with_images = GenerationRequest([5, 6, 7], 8, None, None, images)
    assert not _same_prompt(with_images, with_images, 1)
    assert not _same_prompt(unseeded, with_images, 1)


def test_where_seeds_do_not_matter_single_rows_of_one_budget_join_into_lists():
    a, b, c, d = (GenerationRequest([p, 1], 8, None, None) for p in (5, 6, 7, 8))
    other_budget = GenerationRequest([9, 1], 4, None, None)
    images = RequestImages(png=(b"\x89PNG",), spans=((0, 1),))
    pictured = GenerationRequest([3, 1], 8, None, None, images)
    runs = [[a], [b], [c, c, c], [d], [other_budget], [pictured], [a], [b], [c], [d]]
    assert list(_listed(runs, 3)) == [
        ([a, b], False),  # two prompts' rows: one request listing them
        ([c, c, c], True),  # a prompt's samples stay one request for several completions
        ([d], True),  # alone: the next row has another budget
        ([other_budget], True),
        ([pictured], True),  # rows with images go one request each
        ([a, b, c], False),  # up to the limit
        ([d], True),
    ]
