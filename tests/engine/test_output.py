"""The output path (engine/output.py) with the default model's (byte-level BPE) tokenizer: no delta ever holds half
a character, the deltas add up to the full decoding, and stop strings are cut out even when they straddle tokens."""

import random

import pytest
from transformers import AutoTokenizer

from engine.output import REPLACEMENT_CHAR, IncrementalDetokenizer, SampleOutput, StopStringMatcher
from scheduler import SamplingParams

TEXTS = ["Hello 😀 world", "日本語のテキスト", "a🎉b🎉c", "naïve café — ünïcödé", "plain ascii text, nothing odd."]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.add(ids[start : start + size]))
        start += size
    return deltas + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas = stream(IncrementalDetokenizer(tokenizer), ids, [1] * len(ids))
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "".join(deltas) == text


def test_the_chosen_texts_really_split_characters_over_tokens(tokenizer):
    """Guards the tests above: their tokens decode to U+FFFD one by one, so holding back is exercised."""
    for text in TEXTS[:3]:
        assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in tokenizer.encode(text))


@pytest.mark.parametrize("seed", range(5))
def test_random_chunking_after_a_prompt_adds_up_to_the_full_decoding(tokenizer, seed):
    rng = random.Random(seed)
    prompt = tokenizer.encode("Say something: ")
    ids = tokenizer.encode(" ".join(rng.sample(TEXTS, len(TEXTS))))
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(rng.randint(1, 4))
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt), ids, chunks)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_an_incomplete_character_is_held_until_the_end(tokenizer):
    first_byte = tokenizer.encode("Hello 😀")[1:2]  # ' ' plus the emoji's first bytes
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(first_byte) == ""
    assert detok.flush() == tokenizer.decode(first_byte)


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id]
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids, [1] * len(ids))) == "Hi"


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> str:
    return "".join(matcher.feed(p) for p in pieces) + matcher.flush()


def test_stop_string_across_pieces_is_cut_out():
    m = StopStringMatcher(["o w"])
    assert feed_all(m, ["Hel", "lo", " wo", "rld"]) == "Hell"
    assert m.stopped


def test_a_partial_match_is_held_then_released():
    m = StopStringMatcher(["xyz"])
    assert m.feed("abx") == "ab"
    assert m.feed("y") == ""
    assert m.feed("q") == "xyq"
    assert not m.stopped


def test_held_text_is_released_when_the_stream_ends():
    m = StopStringMatcher(["END"])
    assert m.feed("the EN") == "the "
    assert m.flush() == "EN"


def test_the_earliest_of_several_stop_strings_wins():
    assert feed_all(StopStringMatcher(["world", "lo"]), ["hello world"]) == "hel"


def test_nothing_is_emitted_after_a_stop():
    m = StopStringMatcher(["."])
    assert m.feed("a.b") == "a"
    assert m.feed("more") == ""
    assert m.flush() == ""


def sample_output(tokenizer, stop: list[str], prompt: list[int] = (), **params) -> SampleOutput:
    return SampleOutput(tokenizer, prompt, SamplingParams(stop=stop, **params))


def test_a_stop_string_that_straddles_tokens_ends_the_sample(tokenizer):
    ids = tokenizer.encode("Hello world, how are you?")
    assert tokenizer.decode(ids[:1]) == "Hello"  # the stop string below spans the first two tokens
    sample = sample_output(tokenizer, ["lo wor"])
    out = ""
    for t in ids:
        out += sample.add([t])
        if sample.finish_reason:
            break
    assert out == "Hel" and sample.finish_reason == "stop" and sample.token_ids == ids[:2]


def test_a_stop_string_made_of_multibyte_characters_is_matched(tokenizer):
    ids = tokenizer.encode("x 😀 y 😀 z")
    sample = sample_output(tokenizer, ["😀 z"])
    out = "".join(sample.add([t]) for t in ids[:-1]) + sample.add(ids[-1:], "length")
    assert out == "x 😀 y " and sample.finish_reason == "stop"


def test_the_engine_finish_releases_the_held_text_and_sets_its_reason(tokenizer):
    ids = tokenizer.encode("the END")
    sample = sample_output(tokenizer, ["ENDING"], include_stop_str_in_output=True)
    out = "".join(sample.add([t]) for t in ids[:-1])
    assert sample.finish_reason is None
    out += sample.add(ids[-1:], "length")
    assert out == "the END" and sample.finish_reason == "length"


def test_special_tokens_are_kept_when_asked(tokenizer):
    ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id]
    sample = sample_output(tokenizer, [], skip_special_tokens=False)
    assert sample.add(ids, "stop") == "Hi" + tokenizer.eos_token


def test_include_stop_keeps_the_stop_string_that_matched_first():
    m = StopStringMatcher(["wor", "o w", "xyz"], include_stop=True)
    assert feed_all(m, ["hel", "lo w", "orld"]) == "hello w"
    assert m.stopped


def test_a_stop_string_inside_an_accepted_run_ends_the_text_where_it_does_without_speculation(
    tokenizer, default_model_dir
):
    """The output path cuts stop strings from each delta's tokens; with n-gram speculation a delta carries the
    accepted run, and the stop string here falls inside one: the text is the one without speculation."""
    from engine.inprocess import InProcessEngine
    from raylm import EngineConfig, EngineRequest, SamplingParams

    sentence = "Paris is the capital of France, and the river Seine runs through the middle of it."
    messages = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{sentence}"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

    def serve(**kw) -> tuple[str, int]:
        """The text a stream shows, and how many tokens the delta that hit the stop string carried."""
        engine = InProcessEngine(EngineConfig(model=default_model_dir, device="cpu", **kw))
        engine.add_request(
            EngineRequest(
                request_id="r", prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0.0, max_tokens=48)
            )
        )
        text, sample = "", sample_output(tokenizer, [" runs"], prompt)
        while sample.finish_reason is None:
            (out,) = engine.step()
            text += sample.add(out.new_token_ids, out.finish_reason if out.finished else None)
        return text, len(out.new_token_ids)

    expected, _ = serve()
    got, stop_delta = serve(speculative_config=spec)
    assert got == expected == "Paris is the capital of France, and the river Seine"
    assert stop_delta > 1  # the stop string came inside an accepted run
