"""One request type, one rule and one message per field (``tqbench.engine.request``)."""

from __future__ import annotations

import pytest

from tqbench.engine import GenerationRequest, RequestError, check_context
from tqbench.engine.request import PromptTooLongError, Sampling, check_max_new_tokens


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens=0 is invalid: ask for at least 1 token"),
    (dict(max_new_tokens=-3), "max_new_tokens=-3 is invalid: ask for at least 1 token"),
    (dict(top_p=2.0), "top_p=2 is invalid: use a number in (0, 1]"),
    (dict(top_p=0.0), "top_p=0 is invalid: use a number in (0, 1]"),
    (dict(temperature=-0.5), "temperature=-0.5 is invalid: use 0 (greedy) or a positive number"),
])
def test_a_bad_request_names_its_field(kwargs, message):
    with pytest.raises(RequestError) as info:
        GenerationRequest(**kwargs)
    assert str(info.value) == message and info.value.field == next(iter(kwargs))


def test_a_good_request_gives_its_sampling():
    req = GenerationRequest(8, temperature=0.7, top_p=0.9, seed=3)
    assert req.sampling == Sampling(0.7, 0.9, 3) and not req.sampling.greedy
    assert GenerationRequest(0, echo=True).max_new_tokens == 0  # the prompt alone is scored


def test_a_front_end_spells_the_field_its_own_way():
    with pytest.raises(RequestError) as info:
        check_max_new_tokens(0)
    assert info.value.spelled("max_tokens") == "max_tokens=0 is invalid: ask for at least 1 token"


@pytest.mark.parametrize("n, m, message", [
    (5000, 8, "the prompt has 5000 tokens and m has a context of 4096 tokens: no room is left for new tokens; "
              "shorten the prompt"),
    (4096, None, "the prompt has 4096 tokens and m has a context of 4096 tokens: no room is left for new tokens; "
                 "shorten the prompt"),
    (4000, 200, "the prompt has 4000 tokens and max_new_tokens=200 more were asked for, but m has a context of "
                "4096 tokens: shorten the prompt or lower max_new_tokens to at most 96"),
])
def test_the_context_rule(n, m, message):
    with pytest.raises(PromptTooLongError) as info:
        check_context(n, m, 4096, "m")
    assert str(info.value) == message
    check_context(4096, 0, 4096, "m")  # the prompt alone fits exactly (scored, nothing generated)
    check_context(4000, 96, 4096, "m")
    check_context(10**6, 10, 0, "m")  # no limit known
