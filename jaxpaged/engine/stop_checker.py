"""Stop strings, checked incrementally on a request's output text (never its prompt).

A stop string can arrive split over several tokens ("###" as "#" + "##"), so each check
looks at the newly added characters plus enough old characters before them to complete
any stop string that ends in the new part. Old text was checked on earlier steps, so a
match lying entirely in it cannot exist.
"""

from __future__ import annotations


def check_stop_strings(
    output_text: str,
    new_char_count: int,
    stop: list[str],
    include_stop_str_in_output: bool,
) -> tuple[str, int] | None:
    """Find a stop string that overlaps the last `new_char_count` characters.

    Pure: changes nothing. Returns `(stop_string, truncate_to)` where
    `output_text[:truncate_to]` is the text the request keeps (ending just before the stop
    string, or just after it with `include_stop_str_in_output`), or None when no stop
    string completed. When several match, the one starting earliest wins; on a tie, the
    first in `stop`.
    """
    if new_char_count <= 0 or not stop:
        return None
    new_start = len(output_text) - min(new_char_count, len(output_text))
    best: tuple[int, str] | None = None
    for stop_str in stop:
        # The match must end inside the new text, so it starts at most len(stop_str) - 1
        # characters before it.
        search_from = max(0, new_start - len(stop_str) + 1)
        index = output_text.find(stop_str, search_from)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    truncate_to = index + len(stop_str) if include_stop_str_in_output else index
    return stop_str, truncate_to


def stop_hold_back(stop: list[str], include_stop_str_in_output: bool) -> int:
    """How many trailing characters a stream must not send yet.

    Without this, a stream would send "#" of a "###" stop string before knowing that the
    next token completes it, and the client would keep text the final output drops. When
    the stop string stays in the output there is nothing to take back, so nothing is held.
    """
    if include_stop_str_in_output or not stop:
        return 0
    return max(len(s) for s in stop) - 1
