"""Reasoning parsers (--reasoning-parser): a thinking model's text split into reasoning and answer, whole
and streamed in any pieces (the stream reassembles to the whole), with thinking on and off."""

import random

import pytest

from jaxpaged.reasoning import ReasoningParser


@pytest.mark.parametrize("name, kwargs, text, want", [
    ("qwen3", None, "<think>\nPlan it.\n</think>\n\nThe answer.", ("\nPlan it.\n", "\n\nThe answer.")),
    ("qwen3", None, "Plan it.</think>The answer.", ("Plan it.", "The answer.")),   # <think> in the prompt
    ("qwen3", None, "  <think>Plan</think>", ("Plan", None)),
    ("qwen3", None, "<think>cut short by max_tokens", ("cut short by max_tokens", None)),
    ("qwen3", {"enable_thinking": False}, "The answer, no tags.", (None, "The answer, no tags.")),
    ("qwen3", {"enable_thinking": False}, "a <think>x</think> y", (None, "a <think>x</think> y")),
    ("deepseek_r1", None, "Hmm.</think>42", ("Hmm.", "42")),
    ("deepseek_r1", {"enable_thinking": False}, "Hmm, no end", ("Hmm, no end", None)),   # R1 always thinks
    ("deepseek_r1", None, "a < b </thin k> </think>", ("a < b </thin k> ", None)),
    ("qwen3", None, "<thi", ("<thi", None)),   # not the tag after all: reasoning
    ("deepseek_v3", None, "No thinking asked.", (None, "No thinking asked.")),
    ("deepseek_v3", {"thinking": True}, "Hmm.</think>42", ("Hmm.", "42")),
    ("glm45", None, "<think>Plan.</think>Done.", ("Plan.", "Done.")),
    ("glm45", None, "Plan.</think>Done.", ("Plan.", "Done.")),   # GLM-4.7: <think> in the prompt
    ("glm45", {"enable_thinking": False}, "Straight to it.", (None, "Straight to it.")),
    ("minimax_m2", None, "Plan.</think>\n\nDone.", ("Plan.", "\n\nDone.")),
    ("seed_oss", None, "<seed:think>Budget 512.</seed:think>Answer.", ("Budget 512.", "Answer.")),
    ("seed_oss", None, "cut short <seed:th", ("cut short <seed:th", None)),
    ("seed_oss", None, "a </think> is no end here", ("a </think> is no end here", None)),
])
def test_whole_outputs_split_at_the_tags(name, kwargs, text, want):
    assert ReasoningParser(name, kwargs).extract(text) == want


@pytest.mark.parametrize("seed", range(30))
def test_a_stream_in_random_pieces_reassembles_to_the_whole(seed):
    rng = random.Random(seed)
    name = rng.choice(["qwen3", "deepseek_r1", "glm45", "seed_oss"])
    start, end = ("<seed:think>", "</seed:think>") if name == "seed_oss" else ("<think>", "</think>")
    parts = [rng.choice(["", " ", "\n", start]), "reason < ing </", "thin", "k> " * rng.randint(0, 1),
             rng.choice([end, end[:4], ""]), "ans<wer", rng.choice([end, "<", ""])]
    text = "".join(parts)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
    assert_stream_reassembles(name, [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])


def assert_stream_reassembles(name: str, pieces: list[str]) -> None:
    """Parser `name`'s stream fed `pieces` gives what its extract gives of them joined."""
    parser = ReasoningParser(name)
    stream = parser.stream()
    reasoning = answer = ""
    for k, piece in enumerate(pieces):
        r, a = stream.feed(piece, done=k == len(pieces) - 1)
        reasoning, answer = reasoning + r, answer + a
    assert (reasoning or None, answer or None) == parser.extract("".join(pieces)), pieces
    assert stream.answer == answer


def test_a_partial_tag_is_held_back_until_it_is_known():
    stream = ReasoningParser("qwen3").stream()
    assert stream.feed("<thi", False) == ("", "")       # may be <think>
    assert stream.feed("nk>Plan </th", False) == ("Plan ", "")   # "</th" may end the reasoning
    assert stream.feed("ink>Go", False) == ("", "Go")
    assert stream.feed("</think>", True) == ("", "</think>")   # after the end, tags are answer text


def test_an_unknown_parser_is_named():
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, deepseek_v3, glm45, "
                                         "minimax_m2, openai_gptoss, qwen3, seed_oss, got 'r2'"):
        ReasoningParser("r2")


def test_llm_chat_passes_chat_template_kwargs_to_the_template():
    from jaxpaged import SamplingParams
    from tests.engine.test_llm_generate import tiny_llm

    template = ("{{ messages[0]['content'] }}"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    ask = [{"role": "user", "content": "Hi"}]
    off = tiny_llm().chat(ask, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template,
                          chat_template_kwargs={"enable_thinking": False})[0]
    on = tiny_llm().chat(ask, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template)[0]
    assert off.prompt == "Hi<think></think>" and on.prompt == "Hi"
    with pytest.raises(ValueError, match="chat_template_kwargs must not set tokenize"):
        tiny_llm().chat(ask, chat_template_kwargs={"tokenize": True}, use_tqdm=False)


def test_a_constraint_waits_for_the_end_of_the_reasoning_unless_the_prompt_ended_it():
    from jaxpaged.runner.structured_outputs import AfterReasoning, reasoning_ended

    start, end = (7, 8), (3, 4)
    assert reasoning_ended([1, 7, 8, 9, 3, 4], start, end)       # the template wrote <think></think>
    assert not reasoning_ended([3, 4, 1, 7, 8], start, end)      # it opened one: the model thinks
    assert not reasoning_ended([1, 2, 4], start, end)            # no tags: the model may think

    class Grammar:   # accepts only 5s, stops after two
        def __init__(self):
            self.seen = []

        def consume_token(self, token):
            self.seen.append(token)
            return token == 5

        def is_stopped(self):
            return len(self.seen) == 2

    matcher = AfterReasoning(Grammar(), end)
    assert all(matcher.consume_token(t) for t in (9, 3, 9, 3)) and not matcher.active   # thinking: anything
    assert matcher.consume_token(4) and matcher.active and not matcher.is_stopped()     # 3 4: </think>
    assert matcher.consume_token(5) and not matcher.consume_token(6) and matcher.is_stopped()
    assert matcher.matcher.seen == [5, 6]
