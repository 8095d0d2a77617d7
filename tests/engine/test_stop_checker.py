"""Stop strings as a user sees them: where the text ends, and what a stream lets out."""

import pytest

from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.engine.stop_checker import check_stop_strings, stop_hold_back


class CharTokenizer:
    """One token per character (id = code point): no Rust backend, so the detokenizer
    takes its plain `decode` path, and token boundaries are exactly where we put them."""

    all_special_ids = ()

    def __len__(self):   # ids past it decode to "" (a model's padding rows)
        return 0x110000

    def decode(self, ids, **kwargs):
        return "".join(chr(i) for i in ids)


def run_pieces(pieces, stop, include=False):
    """Feed text pieces as if each were one token; return (final text, stop string, streamed)."""
    text, streamed = "", ""
    hold = stop_hold_back(stop, include)
    for piece in pieces:
        text += piece
        match = check_stop_strings(text, len(piece), stop, include)
        if match is not None:
            stop_str, truncate_to = match
            text = text[:truncate_to]
            return text, stop_str, streamed + text[len(streamed) :]
        ready = len(text) - hold
        if ready > len(streamed):
            streamed = text[:ready]
    return text, None, text


def test_stop_string_split_across_tokens_is_found():
    assert run_pieces(["Answer: 42", "\n#", "#", "# next"], ["###"])[:2] == ("Answer: 42\n", "###")


def test_include_stop_str_in_output_keeps_the_stop_string_and_drops_what_follows():
    text, stop_str, _ = run_pieces(["Answer: 42", "\n#", "#", "# next"], ["###"], include=True)
    assert (text, stop_str) == ("Answer: 42\n###", "###")


def test_earliest_match_wins_over_list_order():
    text = "one END two STOP"
    assert check_stop_strings(text, len(text), ["STOP", "END"], False) == ("END", 4)
    assert check_stop_strings(text, len(text), ["STOP", "END"], True) == ("END", 7)


def test_same_start_ties_go_to_the_first_listed():
    assert check_stop_strings("x abc", 5, ["abc", "ab"], True) == ("abc", 5)
    assert check_stop_strings("x abc", 5, ["ab", "abc"], True) == ("ab", 4)


def test_several_stop_strings_each_stop_generation():
    for stop_str in ["</s>", "\n\n", "Observation:"]:
        pieces = ["Thought: go", f"ing{stop_str[:2]}", stop_str[2:] + "tail"]
        text, matched, _ = run_pieces(pieces, ["</s>", "\n\n", "Observation:"])
        assert (text, matched) == ("Thought: going", stop_str)


def test_match_wholly_inside_old_text_is_not_reported_again():
    # Only stop strings that end in the new characters count: old text was checked before.
    assert check_stop_strings("a STOP b", 2, ["STOP"], False) is None
    assert check_stop_strings("a STOP b", 3, ["STOP"], False) == ("STOP", 2)


def test_no_new_characters_or_no_stops_means_no_match():
    assert check_stop_strings("STOP", 0, ["STOP"], False) is None
    assert check_stop_strings("STOP", 4, [], False) is None
    assert check_stop_strings("ST", 2, ["STOP"], False) is None


def test_new_char_count_larger_than_text_checks_the_whole_text():
    assert check_stop_strings("xSTOP", 99, ["STOP"], False) == ("STOP", 1)


@pytest.mark.parametrize(
    ("stop", "include", "expected"),
    [(["###", "a"], False, 2), (["###"], True, 0), ([], False, 0), (["x"], False, 0)],
)
def test_stop_hold_back(stop, include, expected):
    assert stop_hold_back(stop, include) == expected


def test_stream_never_leaks_part_of_a_stop_string():
    # Without the hold-back, "EN" would go out before "D" completes "END".
    pieces = ["hello ", "E", "N", "D", " more"]
    text, matched, streamed = run_pieces(pieces, ["END"])
    assert matched == "END"
    assert text == streamed == "hello "


def test_stop_string_in_prompt_does_not_stop_output():
    tok = CharTokenizer()
    prompt = [ord(c) for c in "Q: say ### please\nA:"]
    detok = IncrementalDetokenizer(tok, prompt)
    matches = []
    for c in " fine ###":
        delta = detok.add_tokens([ord(c)])
        matches.append(check_stop_strings(detok.output_text, len(delta), ["###", "Q:"], False))
    assert detok.output_text == " fine ###"
    assert matches[:-3] == [None] * (len(matches) - 3)
    assert matches[-1] == ("###", len(" fine "))
