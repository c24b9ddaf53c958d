"""What a request asks of sampling: `SamplingParams` (checked once, where it is made) and the refusal it raises."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class RequestError(ValueError):
    """A request the engine refuses: ``field`` names what is wrong (a SamplingParams field, ``prompt``,
    ``structured_outputs.regex``), with its ``value`` and the ``rule`` it breaks. Raised where the check
    is made, so that the server turns it into a 400 whose ``param`` is the field without reading the message."""

    def __init__(self, field: str, value: object, rule: str, message: str | None = None) -> None:
        super().__init__(message or f"{field}={value!r} is invalid: {rule}")
        self.field, self.value, self.rule = field, value, rule

    def __reduce__(self):  # picklable with its fields: it may cross Ray
        return RequestError, (self.field, self.value, self.rule, str(self))


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on a request's whole output (vLLM's ``structured_outputs``): exactly one kind is set.

    ``json`` is a JSON schema (a dict, or its text), ``json_object`` any JSON
    object, ``regex`` a regular expression the output matches whole,
    ``choice`` one of these strings exactly, ``grammar`` a Lark or GBNF grammar.
    Only the shape is checked here (the scheduler knows no constraint library);
    whether the schema, regex or grammar compiles is checked with the library by
    the engines' entry points (``workers.grammars.compile_grammar``)
    before anything is scheduled. ``compiled`` is what that check compiled, the
    library's grammar: the sampling rank builds its matcher from it, so a
    grammar is compiled once per request, not again on the rank.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    compiled: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object is True else []
        _check(
            len(kinds) == 1,
            "structured_outputs",
            kinds or None,
            "set exactly one of json, json_object, regex, choice, grammar",
        )
        _check(
            self.json is None or isinstance(self.json, (str, dict)),
            "json",
            self.json,
            "must be a JSON schema (a dict or its text)",
        )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, str) and value != "", name, value, "must be a non-empty string")
        _check(
            self.choice is None
            or isinstance(self.choice, (list, tuple))
            and len(self.choice) > 0
            and all(isinstance(c, str) for c in self.choice),
            "choice",
            self.choice,
            "must be a non-empty list of strings",
        )
        _check(isinstance(self.json_object, bool), "json_object", self.json_object, "must be a bool")


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    Validated once at construction so that nothing downstream (scheduler,
    sampler) has to re-check: every bad value (wrong type, bool for a number,
    non-finite, out of range) raises ValueError naming the field and the value.
    The real-valued fields are stored as floats. ``seed`` takes
    torch.Generator.manual_seed's range, [-2**63, 2**64): a negative seed is the
    same generator as seed + 2**64. ``greedy`` rows are argmaxed, including
    temperatures below 1e-5. The scheduler only knows token-level stops; ``stop`` strings (a ``str`` is one),
    ``include_stop_str_in_output`` and ``skip_special_tokens`` are a text concern, honoured where the text is
    built (engine/output.py), for the offline LLM and the server alike.

    ``logit_bias`` adds its value (in [-100, 100], OpenAI's range) to each
    listed token's logit; ``allowed_token_ids`` restricts sampling to those
    ids; ``bad_words_token_ids`` are token sequences never completed (the
    serving layer tokenizes vLLM's ``bad_words``); ``structured_outputs`` restricts it to what keeps the output inside a
    grammar. All three act on the processed logits, so logprobs still
    describe the model's own distribution.

    ``pooling`` ("last" or "mean") makes it an embedding request: once its prompt is computed the ranks return
    its final hidden states pooled that way and L2-normalised instead of sampling a token, and it finishes
    there ("stop"), so it asks for exactly one output (``max_tokens=1``, ``n=1``). ``dimensions`` shortens the
    embedding to its first that many values before normalising (a matryoshka model's, checked against the model
    at the engine boundary).

    ``disable_spec_decode`` opts the request out of speculative decoding (the engine's speculative_config): it
    gets no proposals, as a request the engine cannot speculate for (``speculable``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    pooling: str | None = None
    dimensions: int | None = None
    disable_spec_decode: bool = False

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_token_ids()
        _check(self.pooling in POOLING_TYPES, "pooling", self.pooling, f"must be one of {POOLING_TYPES}")
        _check(
            self.pooling is None or self.max_tokens == 1 and self.n == 1,
            "pooling",
            self.pooling,
            "an embedding request takes max_tokens=1 and n=1",
        )
        _check(
            self.dimensions is None or _is_int(self.dimensions) and self.dimensions >= 1 and self.pooling is not None,
            "dimensions",
            self.dimensions,
            "must be an integer >= 1, on an embedding request (pooling set)",
        )
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            self.structured_outputs,
            "must be a StructuredOutputsParams",
        )

    def _check_numbers(self) -> None:
        for name in _REAL_FIELDS:
            setattr(self, name, _real(name, getattr(self, name)))
        for name in _INT_FIELDS:
            value = getattr(self, name)
            _check(
                value is None and name in ("seed", "logprobs", "prompt_logprobs") or _is_int(value),
                name,
                value,
                "must be an integer",
            )
        _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "must be -1 (off) or >= 1")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        # torch.Generator.manual_seed's range; a negative seed means the same as seed + 2**64 there.
        _check(self.seed is None or -(2**63) <= self.seed < 2**64, "seed", self.seed, "must be in [-2**63, 2**64)")
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"must be in [0, max_tokens={self.max_tokens}]",
        )
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs, "must be None or in [0, 20]"
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            self.prompt_logprobs,
            "must be None or in [0, 20]",
        )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be a bool")
        _check(
            isinstance(self.disable_spec_decode, bool),
            "disable_spec_decode",
            self.disable_spec_decode,
            "must be a bool",
        )

    def _check_token_ids(self) -> None:
        stop = self.stop_token_ids
        _check(
            isinstance(stop, (list, tuple)) and all(_is_int(t) and t >= 0 for t in stop),
            "stop_token_ids",
            self.stop_token_ids,
            "must be a list of non-negative integers",
        )
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop = [self.stop] if isinstance(self.stop, str) else self.stop
        _check(
            isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop),
            "stop",
            self.stop,
            "must be a string or a list of strings",
        )
        self.stop = list(self.stop)
        bias = self.logit_bias
        _check(
            bias is None
            or isinstance(bias, dict)
            and all(
                _is_int(t) and t >= 0 and isinstance(v, (int, float)) and not isinstance(v, bool) and -100 <= v <= 100
                for t, v in bias.items()
            ),
            "logit_bias",
            bias,
            "must map token ids to numbers in [-100, 100]",
        )
        allowed = self.allowed_token_ids
        _check(
            allowed is None
            or isinstance(allowed, (list, tuple))
            and len(allowed) > 0
            and all(_is_int(t) and t >= 0 for t in allowed),
            "allowed_token_ids",
            allowed,
            "must be a non-empty list of non-negative integers",
        )
        bad = self.bad_words_token_ids
        _check(
            bad is None
            or isinstance(bad, (list, tuple))
            and all(isinstance(w, (list, tuple)) and w and all(_is_int(t) and t >= 0 for t in w) for w in bad),
            "bad_words_token_ids",
            bad,
            "must be a list of non-empty token id lists",
        )

    @property
    def speculable(self) -> bool:
        """Whether a request may carry proposals (speculative decoding): its sampling at each position of a run
        must depend on nothing the run itself changes (the ranks verify every position with one processed
        distribution), a seeded sampled request keeps the random stream it has without speculation, and a request
        may opt out (``disable_spec_decode``: its output is the same either way, only its latency and the batch's
        cost change)."""
        return (
            not self.disable_spec_decode
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and self.min_tokens == 0
            and not self.bad_words_token_ids
            and self.structured_outputs is None
            and (self.seed is None or self.greedy)
        )

    @property
    def greedy(self) -> bool:
        # Dividing logits by a temperature this small overflows them to inf/NaN; its argmax is the intent.
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1


POOLING_TYPES = (None, "last", "mean")
_GREEDY_TEMPERATURE = 1e-5  # as vLLM's _SAMPLING_EPS
_REAL_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INT_FIELDS = ("top_k", "max_tokens", "min_tokens", "n", "seed", "logprobs", "prompt_logprobs")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(name: str, value: object) -> float:
    """``value`` as a finite float, or ValueError: a bool, str or inf would only fail later, in the sampler."""
    _check(isinstance(value, (int, float)) and not isinstance(value, bool), name, value, "must be a number")
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond float range
        as_float = math.inf
    _check(math.isfinite(as_float), name, value, "must be finite")
    return as_float


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise RequestError(name, value, rule)
