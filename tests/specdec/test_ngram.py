"""Prompt-lookup proposals."""

from specdec.decoding.proposers import find_continuation


def test_longest_suffix_match_proposes_what_followed():
    context = [1, 2, 3, 4, 5, 9, 2, 3, 4]
    assert find_continuation(context, 3, 1, 4) == [5, 9, 2]


def test_most_recent_occurrence_wins():
    context = [7, 1, 7, 2, 7]
    assert find_continuation(context, 1, 1, 1) == [2]


def test_no_match_proposes_nothing():
    assert find_continuation([1, 2, 3, 4], 4, 1, 3) == []


def test_proposal_stops_at_end_of_context():
    assert find_continuation([5, 6, 5], 4, 1, 2) == [6, 5]


def test_min_n_is_respected():
    assert find_continuation([1, 2, 3, 1], 2, 2, 3) == []
    assert find_continuation([1, 2, 3, 1], 2, 1, 3) == [2, 3]
