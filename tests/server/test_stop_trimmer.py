"""Stop sequences: held back while they might be starting, cut (and never returned) once complete."""

from __future__ import annotations

from tqbench.server.stream import StopTrimmer


def test_text_before_a_stop_is_released_and_the_stop_is_cut():
    t = StopTrimmer(["END"])
    assert [t.push(d) for d in ("abc", "E", "N", "D and more")] == ["abc", "", "", ""]
    assert t.final_text == "abc" and t.flush() == ""


def test_a_false_start_is_released_when_it_stops_matching():
    t = StopTrimmer(["END"])
    assert t.push("xE") == "x"
    assert t.push("Ny") == "ENy"
    assert t.push("EN") == ""
    assert t.flush() == "EN"  # generation ended: nothing held back is lost
    assert t.final_text == "xENyEN"


def test_earliest_of_several_stops_wins_even_inside_one_delta():
    t = StopTrimmer(["\n\n", "b"])
    assert t.push("aa\n\nxb") == "aa"
    assert t.final_text == "aa"


def test_no_stops_passes_text_through():
    t = StopTrimmer(None)
    assert t.push("hé") == "hé" and t.push("llo") == "llo" and t.final_text == "héllo"
