"""A sample's output text, built from its token ids a few at a time (vLLM v1's detokenizer and stop checker, used
by its offline and its server engines alike): never half a character, never (part of) a stop string."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler import SamplingParams

REPLACEMENT_CHAR = "\ufffd"  # what a decoder renders an incomplete UTF-8 sequence as
# Prompt tokens decoded in front of the output: tokenizers that drop or merge a leading space
# (SentencePiece) render the first output token right only with its left neighbours.
CONTEXT_TOKENS = 5


def decoder(tokenizer) -> Callable[[list[int], bool], str]:
    """``decode(ids, skip_special_tokens)``: the Rust tokenizer itself where decoding is only that (a fast
    tokenizer that cleans up no spaces), since transformers' wrapper costs 4x the decode of a few tokens and
    a server decodes twice per streamed chunk; the wrapper otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas in O(window) per step.

    Invariants: ``ids[:read_offset]`` are the tokens whose text has been
    returned; each step decodes only ``ids[prefix_offset:]`` (the last emitted
    tokens as context, plus the new ones) and returns what it adds to the
    decoding of ``ids[prefix_offset:read_offset]``. Text that ends in U+FFFD (a
    multi-byte character split over tokens) is held back until a later token
    completes it, so no delta ever holds half a character; ``flush()`` gives
    what is still held when the sequence ends.
    """

    __slots__ = ("decode", "ids", "prefix_offset", "read_offset", "skip_special_tokens")

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.decode = decoder(tokenizer)
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.skip_special_tokens = skip_special_tokens

    def add(self, token_ids: Sequence[int]) -> str:
        """The text the new tokens complete ("" while a character is still incomplete)."""
        self.ids.extend(token_ids)
        prefix, text = self._window()
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """The text still held back at the end (an incomplete character stays U+FFFD)."""
        prefix, text = self._window()
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :]

    def _window(self) -> tuple[str, str]:
        decode, skip = self.decode, self.skip_special_tokens
        return decode(self.ids[self.prefix_offset : self.read_offset], skip), decode(
            self.ids[self.prefix_offset :], skip
        )


class StopStringMatcher:
    """Cuts a text stream at the first stop string, holding back whatever could still become one.

    Invariants: the emitted text never contains a stop string, nor any part
    of the one that matched (unless ``include_stop``: then it ends with the
    matched stop string, as vLLM's ``include_stop_str_in_output``); ``held`` is the longest suffix of the text seen
    that is a proper prefix of some stop string (so a stop string can never
    begin inside text already emitted). Once ``stopped``, nothing more is
    emitted.
    """

    __slots__ = ("stops", "held", "stopped", "include_stop")

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False
        self.include_stop = include_stop

    def feed(self, text: str) -> str:
        """The part of ``text`` (after what was held) that is safe to emit."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        text = self.held + text
        hits = [(i, -len(s)) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            self.stopped, self.held = True, ""
            start, minus_len = min(hits)  # the earliest, and the longest of those starting there
            return text[: start - minus_len if self.include_stop else start]
        keep = max(
            (k for s in self.stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])), default=0
        )
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of the stream what was held cannot become a stop string any more."""
        held, self.held = self.held, ""
        return "" if self.stopped else held


class SampleOutput:
    """One sample's output as its engine deltas arrive: its token ids, its text (detokenized incrementally, then
    cut at the first of ``params.stop``) and how it ended. The offline LLM and the server build every
    completion's text with it, so both return the same text and finish reason for the same tokens.

    Invariants: ``finish_reason`` is set once, "stop" as soon as a stop string matched (the caller then ends
    the sample in the engine and drops its later deltas) or the engine's reason on its final delta, when the
    text still held back is released; the deltas ``add`` returns concatenate to the sample's whole text.
    """

    __slots__ = ("detokenizer", "matcher", "token_ids", "finish_reason")

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None

    def add(self, token_ids: Sequence[int], finish_reason: str | None = None) -> str:
        """The text ``token_ids`` add; ``finish_reason``: the engine's, on the sample's final delta."""
        self.token_ids += token_ids
        text = self.matcher.feed(self.detokenizer.add(token_ids))
        if self.matcher.stopped:
            self.finish_reason = "stop"
        elif finish_reason is not None:
            self.finish_reason = finish_reason
            text += self.matcher.feed(self.detokenizer.flush()) + self.matcher.flush()
        return text
