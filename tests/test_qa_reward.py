"""F1 and exact match for QA answers (SQuAD normalisation, best over the references)."""

import pytest

from areal_pipeline.rewards import exact_match_reward, f1_reward, normalize_answer


def test_normalisation_drops_case_punctuation_articles_and_extra_spaces():
    assert normalize_answer("  The  Eiffel-Tower, in PARIS! ") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # "the" only as a word


def test_exact_match():
    assert exact_match_reward("the Beatles.", ["Beatles"]) == 1.0
    assert exact_match_reward("The Beatles band", ["Beatles"]) == 0.0
    assert exact_match_reward("Paris", ["Lyon", "paris"]) == 1.0
    assert exact_match_reward("Paris", "Paris") == 1.0  # a single reference as a string


def test_f1_by_hand():
    # prediction {new, york, city} vs reference {new, york}: precision 2/3, recall 1 -> F1 0.8
    assert f1_reward("New York City", ["New York"]) == pytest.approx(0.8)
    assert f1_reward("York", ["New York"]) == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert f1_reward("Boston", ["New York"]) == 0.0
    assert f1_reward("", ["New York"]) == 0.0
    # repeated words count once per occurrence in both
    assert f1_reward("york york", ["new york"]) == pytest.approx(0.5)


def test_f1_takes_the_best_reference():
    assert f1_reward("October 1922", ["1922", "October 1922"]) == 1.0
    assert f1_reward("in 1922", ["October 1922", "1922"]) == pytest.approx(2 * 0.5 * 1 / 1.5)


def test_yes_no_get_no_partial_credit():
    assert f1_reward("yes", ["no"]) == 0.0
    assert f1_reward("no it was not", ["no"]) == 0.0
    assert f1_reward("Yes.", ["yes"]) == 1.0


def test_needs_a_reference():
    with pytest.raises(ValueError, match="at least one reference"):
        f1_reward("x", [])
    with pytest.raises(ValueError, match="at least one reference"):
        exact_match_reward("x", [])
