"""The generation vocabulary: what every hop (gateway, router, worker) says about one generation,
in one torch-free module, converted to and from protobuf here and nowhere else.

    s = Sampling(max_new_tokens=32, temperature=0.7, top_p=0.9, seed=5)
    s.validate()                         # GenerationError naming the field, e.g. "sampling.top_p: ..."
    msg = s.to_pb(); Sampling.from_pb(msg) == s

- `Sampling`: how to pick tokens and when to stop. On the wire (`bitdelta.common.v1.SamplingParams`)
  a zero means "unset" (proto3), so `from_pb` turns zeros into the defaults the fields document.
- `Constraint`: what a constrained output must be (a JSON schema, any JSON object, a regex, one of
  some strings, a grammar), carried in `Sampling.constraint`; `bitdelta.grammar` compiles it.
- `FinishReason` and `ArrivalState`: why a generation ended, where its variant was on arrival.
- `Ttft`: where the time to first token went.
- `TokenEvent`: one streamed token, as the worker's engine makes it and the router passes it on;
  `fill_stream_pb` / `events_of_stream_pb`: the tokens of one stream message (all that were ready).
- `check_model_id`: the one rule for model (variant, delta) names, the store's, router's and
  worker's alike; `MODEL_ID_RULE` says it in words.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from bitdelta.common.v1 import generation_pb2 as pb
from bitdelta.rpc.errors import ServiceError, clip

# -- names -----------------------------------------------------------------------------------------------

MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MODEL_ID_RULE = "1-128 letters, digits, '_', '-' or '.', starting with a letter or digit, without '..'"


class GenerationError(ServiceError, ValueError):
    """A request field out of its rule; `field` names it (dotted, e.g. "sampling.top_p"), and the
    message starts with it. Every service answers it with INVALID_ARGUMENT (a `ServiceError`)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def check_number(name: str, v: object, lo: float, hi: float, low_open: bool = False) -> float:
    """`v` as a JSON number in [lo, hi] ((lo, hi] with low_open), or GenerationError naming `name`."""
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not math.isfinite(v)
        or not (lo < v <= hi if low_open else lo <= v <= hi)
    ):
        what = f"greater than {lo:g} and at most {hi:g}" if low_open else f"between {lo:g} and {hi:g}"
        raise GenerationError(name, f"must be a number {what}, got {str(v)[:40]}")
    return float(v)


def check_integer(name: str, v: object, lo: int, hi: int) -> int:
    """`v` as a JSON integer in [lo, hi], or GenerationError naming `name`."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise GenerationError(name, f"must be an integer between {lo} and {hi}, got {str(v)[:40]}")
    return v


def check_defaultable(name: str, v: object) -> float | int:
    """`v` as the value of DEFAULTABLE field `name`, or GenerationError naming it."""
    kind, lo, hi, low_open = DEFAULTABLE[name]
    return check_integer(name, v, int(lo), int(hi)) if kind is int else check_number(name, v, lo, hi, low_open)


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves one of these fields unset (absent or null) gets: a model's
    generation config, as vLLM's server takes it (`--generation-config auto`); the neutral values
    (OpenAI's and vLLM's own) where the config sets none."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 0  # chat's max_tokens, cut to the context the prompt leaves; 0: the worker's default

    @classmethod
    def from_config(cls, config: object) -> SamplingDefaults:
        """A generation config's object -> its defaults: each DEFAULTABLE key it sets (not null)
        under its rule; GenerationError naming the first one out of it."""
        if not isinstance(config, dict):
            raise GenerationError("generation config", "must be a JSON object")
        out = {k: check_defaultable(k, config[k]) for k in GENERATION_CONFIG_KEYS if config.get(k) is not None}
        if "top_k" in out:
            out["top_k"] = max(out["top_k"], 0)
        return cls(**out)

    def to_pb(self) -> pb.SamplingDefaults:
        return pb.SamplingDefaults(**dataclasses.asdict(self))

    @classmethod
    def from_pb(cls, m: pb.SamplingDefaults) -> SamplingDefaults:
        """The message's values, under their rules (GenerationError naming a field out of one)."""
        d = {f.name: getattr(m, f.name) for f in dataclasses.fields(cls)}
        return cls.from_config({k: v for k, v in d.items() if not (k == "max_new_tokens" and v == 0)})

    def changed(self) -> dict[str, float]:
        """The fields that differ from the neutral values (the gateway logs them at start, as vLLM warns)."""
        neutral = SamplingDefaults()
        return {k: v for k, v in dataclasses.asdict(self).items() if v != getattr(neutral, k)}


def is_model_id(name: object) -> bool:
    """Whether `name` is a model name: no path separator, parent directory, hidden file or control
    character can pass, so the store may use it as a file or object name."""
    return isinstance(name, str) and MODEL_ID.fullmatch(name) is not None and ".." not in name


def check_model_id(name: str, field: str = "model_id") -> str:
    """`name`, or GenerationError naming `field` (the empty string, the base, is not checked here)."""
    if not is_model_id(name):
        raise GenerationError(field, f"{clip(str(name))} is not a model name: {MODEL_ID_RULE}")
    return name


# -- sampling --------------------------------------------------------------------------------------------

MIN_TEMPERATURE = 1e-3  # below this logits / temperature overflows fp32; 0 means greedy
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # stop strings are searched on the engine thread every token
MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # allowed_token_ids (vLLM sets none): the largest vocabularies (Gemma 3: 262k)
MAX_BAD_WORDS = 64
MAX_REPETITION_PENALTY = 100.0
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
# The keys of a model's generation_config.json that vLLM's server takes as request defaults
# (get_diff_sampling_param; the gateway's --generation-config), each under the rule of the OpenAI
# request field of its name: (type, low, high, low end open); the other keys change no request.
DEFAULTABLE: dict[str, tuple[type, float, float, bool]] = {
    "temperature": (float, 0.0, 2.0, False),
    "top_p": (float, 0.0, 1.0, True),
    "top_k": (int, -1, 1 << 30, False),  # -1 (vLLM's) and 0: no limit
    "min_p": (float, 0.0, 1.0, False),
    "repetition_penalty": (float, 0.0, 100.0, True),
    "max_new_tokens": (int, 1, 2**31 - 1, False),  # chat's max_tokens
}
GENERATION_CONFIG_KEYS = tuple(DEFAULTABLE)
MAX_BIAS, MAX_LOGIT_BIAS = 100.0, 1024  # OpenAI's range of a bias; how many tokens one request may bias
MAX_N = 16  # choices of one request (each a running sequence after the shared prefill)


# -- constraints -----------------------------------------------------------------------------------------

MAX_CONSTRAINT_CHARS = 65536  # a schema, regex or grammar; llguidance's own limits bound what it compiles to
MAX_CHOICES, MAX_CHOICE_CHARS = 256, 1024
MAX_AFTER_CHARS = 64  # Constraint.after: a closing tag


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # JSON valid under the schema in `text`
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"  # text the regular expression in `text` matches whole
    CHOICE = "choice"  # exactly one of `choices`
    GRAMMAR = "grammar"  # text the grammar in `text` (Lark, or GBNF with "::=") derives

    def to_pb(self) -> int:
        return _KIND_PB[self]


@dataclass(frozen=True)
class Constraint:
    """What a constrained output must be (hashable: the worker caches compiled grammars by it)."""

    kind: ConstraintKind
    text: str = ""  # JSON_SCHEMA: the schema as JSON text; REGEX: the pattern; GRAMMAR: the grammar
    choices: tuple[str, ...] = ()  # CHOICE only
    # non-empty: the output is free up to and including the first `after`, the constraint binds the rest
    # (a reasoning model's thinking, closed by "</think>")
    after: str = ""

    def validate(self) -> Constraint:
        """self, or GenerationError ("sampling.constraint: ...") for a constraint out of shape; whether
        the schema, regex or grammar compiles is `bitdelta.grammar.check`'s."""
        f, k = "sampling.constraint", self.kind
        has_text = k in (ConstraintKind.JSON_SCHEMA, ConstraintKind.REGEX, ConstraintKind.GRAMMAR)
        if has_text and not self.text:
            raise GenerationError(f, f"a {k.value} constraint needs its text")
        if not has_text and self.text:
            raise GenerationError(f, f"a {k.value} constraint has no text")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise GenerationError(
                f, f"the {k.value} is {len(self.text)} characters long; at most {MAX_CONSTRAINT_CHARS}"
            )
        if len(self.after) > MAX_AFTER_CHARS:
            raise GenerationError(f, f"the text the constraint binds after is at most {MAX_AFTER_CHARS} characters")
        if (k is ConstraintKind.CHOICE) != bool(self.choices):
            raise GenerationError(f, "choices belong to a choice constraint, and it needs at least one")
        if len(self.choices) > MAX_CHOICES:
            raise GenerationError(f, f"{len(self.choices)} choices; at most {MAX_CHOICES}")
        for c in self.choices:
            if not c or len(c) > MAX_CHOICE_CHARS:
                raise GenerationError(f, f"choice {clip(c)} must be 1 to {MAX_CHOICE_CHARS} characters long")
        if k is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.text)
            except (ValueError, RecursionError) as e:
                raise GenerationError(f, f"the JSON schema is not valid JSON: {clip(str(e))}") from None
            if not isinstance(schema, dict):
                raise GenerationError(f, "the JSON schema must be a JSON object")
        return self

    def to_pb(self) -> pb.Constraint:
        return pb.Constraint(kind=self.kind.to_pb(), text=self.text, choices=list(self.choices), after=self.after)

    @classmethod
    def from_pb(cls, m: pb.Constraint) -> Constraint | None:
        """None for CONSTRAINT_KIND_UNSPECIFIED (free text); GenerationError for a kind this side does not know."""
        if m.kind == pb.CONSTRAINT_KIND_UNSPECIFIED:
            return None
        kind = _KIND_OF_PB.get(m.kind)
        if kind is None:
            raise GenerationError("sampling.constraint", f"unknown constraint kind {m.kind}")
        return cls(kind, m.text, tuple(m.choices), m.after)


_KIND_PB = {
    ConstraintKind.JSON_SCHEMA: pb.CONSTRAINT_KIND_JSON_SCHEMA,
    ConstraintKind.JSON_OBJECT: pb.CONSTRAINT_KIND_JSON_OBJECT,
    ConstraintKind.REGEX: pb.CONSTRAINT_KIND_REGEX,
    ConstraintKind.CHOICE: pb.CONSTRAINT_KIND_CHOICE,
    ConstraintKind.GRAMMAR: pb.CONSTRAINT_KIND_GRAMMAR,
}
_KIND_OF_PB = {v: k for k, v in _KIND_PB.items()}


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens and when to stop (defaults: greedy, the server's max_new_tokens)."""

    max_new_tokens: int = 0  # 0: the server's default
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p; 1: all
    stop: tuple[str, ...] = ()  # end when the text contains one of these (not returned, unless asked)
    seed: int | None = None  # same seed, same tokens, whatever else is batched; None: a random seed
    top_k: int = 0  # keep the k most likely tokens; 0: all
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely one; 0: all
    repetition_penalty: float = 1.0  # tokens of the prompt or the output: logit / p if > 0 else logit * p
    presence_penalty: float = 0.0  # minus this for every token the output already holds
    frequency_penalty: float = 0.0  # minus this times how often the output holds the token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending
    stop_token_ids: tuple[int, ...] = ()  # end when one of these is produced (its text not returned)
    min_tokens: int = 0  # neither EOS, a stop token nor a stop string ends the output before this many
    ignore_eos: bool = False  # EOS does not end the output
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) is returned too
    logprobs: int | None = None  # the sampled token's logprob and this many alternatives (raw logits)
    n: int = 1  # choices, forked after one shared prefill; choice i of a seeded request: choice_seed(i)
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs, ranks and this many alternatives
    constraint: Constraint | None = None  # the output must satisfy it (masks per step); None: free text
    # the prompt's last k tokens only (vLLM's left truncation); -1: as many as the context leaves for
    # max_new_tokens; None: the whole prompt
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: tuple[int, ...] = ()  # only these may be picked (vLLM's); empty: any
    skip_special_tokens: bool = True  # False: special tokens' text stays in the output (vLLM's)
    bad_words: tuple[str, ...] = ()  # the output never completes one of these (vLLM's; the worker tokenizes them)
    return_prompt_token_ids: bool = False  # the first event carries the prompt's ids as run (vLLM's return_token_ids)
    # max_new_tokens 0: at most this many, cut to the context the prompt leaves (the model's generation
    # config's, passed on by the gateway); 0: the server's default
    default_max_new_tokens: int = 0

    @property
    def plain(self) -> bool:
        """Nothing changes the logits before the pick: greedy is the batch's argmax."""
        return (
            self.repetition_penalty == 1.0
            and not self.presence_penalty
            and not self.frequency_penalty
            and not self.logit_bias
            and not self.min_tokens
            and not self.allowed_token_ids
            and not self.bad_words
            and self.constraint is None
        )

    def validate(self) -> Sampling:
        """self, or GenerationError naming the first field out of its rule."""
        t = self.temperature
        if not (t == 0 or (math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
            raise GenerationError(
                "sampling.temperature", f"{t!r} must be 0 (greedy) or between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}"
            )
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise GenerationError("sampling.top_p", f"{self.top_p!r} must be in (0, 1] (1: no truncation)")
        for name in ("max_new_tokens", "default_max_new_tokens"):
            if not 0 <= getattr(self, name) < 2**32:
                raise GenerationError(
                    f"sampling.{name}", f"{getattr(self, name)} must be >= 0 (0: the server's default)"
                )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise GenerationError("sampling.stop", f"{len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_CHARS:
                raise GenerationError("sampling.stop", f"{clip(s)} must be 1 to {MAX_STOP_CHARS} characters long")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise GenerationError("sampling.seed", f"{self.seed} must be in [0, 2**64)")
        if not 0 <= self.top_k < 2**31:
            raise GenerationError("sampling.top_k", f"{self.top_k} must be >= 0 (0: no limit)")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise GenerationError("sampling.min_p", f"{self.min_p!r} must be in [0, 1]")
        rp = self.repetition_penalty
        if not (math.isfinite(rp) and 0.0 < rp <= MAX_REPETITION_PENALTY):
            raise GenerationError(
                "sampling.repetition_penalty", f"{rp!r} must be in (0, {MAX_REPETITION_PENALTY:g}] (1: none)"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
                raise GenerationError(f"sampling.{name}", f"{v!r} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise GenerationError("sampling.logit_bias", f"{len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}")
        for tok, bias in self.logit_bias:
            if tok < 0 or not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
                raise GenerationError(
                    "sampling.logit_bias", f"token {tok}: {bias!r} must be between -{MAX_BIAS:g} and {MAX_BIAS:g}"
                )
        if len(self.bad_words) > MAX_BAD_WORDS or any(not w or len(w) > MAX_STOP_CHARS for w in self.bad_words):
            raise GenerationError(
                "sampling.bad_words", f"at most {MAX_BAD_WORDS} words of 1 to {MAX_STOP_CHARS} characters"
            )
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS or any(t < 0 for t in self.allowed_token_ids):
            raise GenerationError("sampling.allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} token ids >= 0")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in self.stop_token_ids):
            raise GenerationError("sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids >= 0")
        if self.min_tokens < 0 or (self.max_new_tokens and self.min_tokens > self.max_new_tokens):
            raise GenerationError(
                "sampling.min_tokens",
                f"{self.min_tokens} must be >= 0 and at most max_new_tokens ({self.max_new_tokens})",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise GenerationError("sampling.logprobs", f"{self.logprobs} must be between 0 and {MAX_LOGPROBS}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise GenerationError(
                "sampling.prompt_logprobs", f"{self.prompt_logprobs} must be between 0 and {MAX_LOGPROBS}"
            )
        if not 1 <= self.n <= MAX_N:
            raise GenerationError("sampling.n", f"{self.n} must be between 1 and {MAX_N}")
        t = self.truncate_prompt_tokens
        if t is not None and not (t == -1 or 1 <= t < 2**31):
            raise GenerationError(
                "sampling.truncate_prompt_tokens", f"{t} must be >= 1, or -1 (as many as the context leaves)"
            )
        if self.constraint is not None:
            self.constraint.validate()
            # the grammar says where the output may end: EOS is allowed exactly there
            for name in ("min_tokens", "ignore_eos", "allowed_token_ids", "bad_words"):
                if getattr(self, name):
                    raise GenerationError(
                        f"sampling.{name}",
                        "cannot be combined with a constraint (the grammar decides where the output ends)",
                    )
        return self

    def choice_seed(self, index: int) -> int | None:
        """The seed choice `index` draws with: the request's for choice 0 (n = 1 and choice 0 of
        n agree), a distinct one derived from it for the others; None: unseeded."""
        if self.seed is None or index == 0:
            return self.seed
        return (self.seed + index * 0x9E3779B97F4A7C15) % 2**64

    def check_vocab(self, vocab_size: int) -> Sampling:
        """self, or GenerationError for a token id the model does not have."""
        for name, ids in (
            ("logit_bias", [t for t, _ in self.logit_bias]),
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise GenerationError(
                    f"sampling.{name}", f"token {bad[0]} is not below the vocabulary size {vocab_size}"
                )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_pb(self) -> pb.SamplingParams:
        return pb.SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=0.0 if self.top_p == 1.0 else self.top_p,
            stop=list(self.stop),
            seed=self.seed,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=0.0 if self.repetition_penalty == 1.0 else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=dict(self.logit_bias),
            stop_token_ids=list(self.stop_token_ids),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.logprobs,
            n=0 if self.n == 1 else self.n,
            prompt_logprobs=self.prompt_logprobs,
            constraint=None if self.constraint is None else self.constraint.to_pb(),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            allowed_token_ids=list(self.allowed_token_ids),
            skip_special_tokens=None if self.skip_special_tokens else False,
            bad_words=list(self.bad_words),
            return_prompt_token_ids=self.return_prompt_token_ids,
            default_max_new_tokens=self.default_max_new_tokens,
        )

    @classmethod
    def from_pb(cls, m: pb.SamplingParams) -> Sampling:
        """The message's values, zeros read as unset (not validated: call `validate`)."""
        return cls(
            max_new_tokens=m.max_new_tokens,
            temperature=m.temperature,
            top_p=m.top_p or 1.0,
            stop=tuple(m.stop),
            seed=m.seed if m.HasField("seed") else None,
            top_k=m.top_k,
            min_p=m.min_p,
            repetition_penalty=m.repetition_penalty or 1.0,
            presence_penalty=m.presence_penalty,
            frequency_penalty=m.frequency_penalty,
            logit_bias=tuple(sorted(m.logit_bias.items())),
            stop_token_ids=tuple(m.stop_token_ids),
            min_tokens=m.min_tokens,
            ignore_eos=m.ignore_eos,
            include_stop_str_in_output=m.include_stop_str_in_output,
            logprobs=m.logprobs if m.HasField("logprobs") else None,
            n=m.n or 1,
            prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
            constraint=Constraint.from_pb(m.constraint),
            truncate_prompt_tokens=m.truncate_prompt_tokens if m.HasField("truncate_prompt_tokens") else None,
            allowed_token_ids=tuple(m.allowed_token_ids),
            skip_special_tokens=m.skip_special_tokens if m.HasField("skip_special_tokens") else True,
            bad_words=tuple(m.bad_words),
            return_prompt_token_ids=m.return_prompt_token_ids,
            default_max_new_tokens=m.default_max_new_tokens,
        )


MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 256


@dataclass(frozen=True)
class Request:
    """One generation asked of a router or a worker."""

    model_id: str  # a variant; "" or the base's name: the base
    prompt: str
    sampling: Sampling = field(default_factory=Sampling)
    request_id: str = ""  # the caller's id, echoed in traces and logs
    deadline: float | None = None  # time.monotonic() by which it must end; None: the server's timeout
    # the tokenizer adds no special tokens (BOS) of its own: a rendered chat template, which writes the
    # ones it wants, or a prompt sent with vLLM's add_special_tokens: false
    templated: bool = False
    priority: int = 0  # lower first, FIFO within a value (vLLM's); orders admission and preemption
    cache_salt: str = ""  # vLLM's: only requests with the same salt share prefix-cached KV blocks
    # the prompt as token ids instead of text (prompt then ""): used as they are, no special tokens added
    prompt_token_ids: tuple[int, ...] = ()

    def validate(self) -> Request:
        """self, or GenerationError naming the field (the prompt's limits are each service's; the
        ids' range is the worker's, which knows the vocabulary)."""
        if self.model_id:
            check_model_id(self.model_id)
        if self.prompt and self.prompt_token_ids:
            raise GenerationError("prompt_token_ids", "the prompt as text or as token ids, not both")
        if self.prompt_token_ids and self.templated:
            raise GenerationError("prompt_token_ids", "token ids are not a rendered chat template (templated)")
        if len(self.request_id) > MAX_REQUEST_ID_CHARS:
            raise GenerationError("request_id", f"{len(self.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise GenerationError("cache_salt", f"{len(self.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}")
        self.sampling.validate()
        return self

    @classmethod
    def from_pb(cls, m, deadline: float | None = None) -> Request:
        """From a router's or a worker's GenerateRequest (the same fields); not validated."""
        return cls(
            m.model_id,
            m.prompt,
            Sampling.from_pb(m.sampling),
            m.request_id,
            deadline,
            m.templated,
            m.priority,
            m.cache_salt,
            tuple(m.prompt_token_ids),
        )


# -- events ----------------------------------------------------------------------------------------------


class FinishReason(enum.Enum):
    """Why a generation ended."""

    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos"  # the model's end-of-sequence token
    STOP = "stop"  # a stop string
    CANCELLED = "cancelled"  # cancelled, or its deadline passed

    def to_pb(self) -> int:
        return _FINISH_PB[self]

    @classmethod
    def from_pb(cls, value: int) -> FinishReason | None:
        """None for FINISH_REASON_UNSPECIFIED (not finished)."""
        return _FINISH_OF_PB.get(value)


_FINISH_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}
_FINISH_OF_PB = {v: k for k, v in _FINISH_PB.items()}


class ArrivalState(enum.Enum):
    """Where a request's variant was on the worker that served it, when the request arrived."""

    BASE = "base"  # the base itself: always resident
    RESIDENT = "resident"
    LOADING = "loading"  # being loaded for another request
    COLD = "cold"  # absent: this request's arrival caused the load


@dataclass(frozen=True)
class Ttft:
    """Where the time to first token went, in milliseconds; parts that do not apply are 0."""

    queue_ms: float = 0.0  # the router's admission queue and placement
    delta_load_ms: float = 0.0  # waiting for the variant's delta to become resident
    schedule_ms: float = 0.0  # waiting for a batch slot and KV-cache space
    prefill_ms: float = 0.0  # the prompt through the model
    total_ms: float = 0.0  # arrival to the first token leaving the hop that reports it

    def to_pb(self) -> pb.TtftBreakdown:
        return pb.TtftBreakdown(
            queue_ms=self.queue_ms,
            delta_load_ms=self.delta_load_ms,
            schedule_ms=self.schedule_ms,
            prefill_ms=self.prefill_ms,
            total_ms=self.total_ms,
        )

    @classmethod
    def from_pb(cls, m: pb.TtftBreakdown) -> Ttft:
        return cls(m.queue_ms, m.delta_load_ms, m.schedule_ms, m.prefill_ms, m.total_ms)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def to_pb(self) -> pb.Usage:
        return pb.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)

    @classmethod
    def from_pb(cls, m: pb.Usage) -> Usage:
        return cls(m.prompt_tokens, m.completion_tokens)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str  # the token decoded alone
    logprob: float  # log softmax of the raw logits

    def to_pb(self) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=self.token_id, token=self.token, logprob=self.logprob)

    @classmethod
    def from_pb(cls, m: pb.TokenLogprob) -> TokenLogprob:
        return cls(m.token_id, m.token, m.logprob)


@dataclass(frozen=True)
class Logprobs:
    """The sampled token's log-probability and the most likely tokens at its position."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()
    rank: int = 0  # a prompt token's rank in the vocabulary (1: most likely, ties against it); 0: none

    def to_pb(self) -> pb.Logprobs:
        return pb.Logprobs(sampled=self.sampled.to_pb(), top=[t.to_pb() for t in self.top], rank=self.rank)

    @classmethod
    def from_pb(cls, m: pb.Logprobs) -> Logprobs:
        return cls(TokenLogprob.from_pb(m.sampled), tuple(TokenLogprob.from_pb(t) for t in m.top), m.rank)


@dataclass(frozen=True)
class TokenEvent:
    """One streamed token. The first event of a generation carries `ttft` and `arrival` (and, from
    the router, `worker`); the last carries `finish_reason` and `usage`."""

    token_id: int
    text: str  # what the token adds (may be empty while a multi-byte character is incomplete)
    elapsed_ms: float  # since the request reached the hop that sends the event
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    ttft: Ttft | None = None
    arrival: ArrivalState | None = None
    worker: str = ""  # the worker that served it (the router's events)
    logprobs: Logprobs | None = None  # with Sampling.logprobs
    index: int = 0  # the choice (Sampling.n > 1); each choice's last event has its own finish and usage
    prompt_logprobs: tuple[Logprobs, ...] = ()  # Sampling.prompt_logprobs, first event: per prompt token
    prompt_token_ids: tuple[int, ...] = ()  # Sampling.return_prompt_token_ids, first event: the prompt as run
    stop_reason: str | int | None = None  # with FinishReason.STOP: the stop string, or the stop token's id
    prefill_batch: int = field(default=0, compare=False)  # sequences in the step that began its prefill (traces)

    def token_pb(self) -> pb.Token:
        """The token's own fields (`bitdelta.common.v1.Token`); the request's (ttft, arrival, worker,
        prompt logprobs) travel on the stream message, `fill_stream_pb`."""
        t = pb.Token(token_id=self.token_id, text=self.text, elapsed_ms=self.elapsed_ms, index=self.index)
        if self.finish_reason is not None:
            t.finish_reason = self.finish_reason.to_pb()
        if self.usage is not None:
            t.usage.CopyFrom(self.usage.to_pb())
        if self.logprobs is not None:
            t.logprobs.CopyFrom(self.logprobs.to_pb())
        if isinstance(self.stop_reason, str):
            t.stop_string = self.stop_reason
        elif self.stop_reason is not None:
            t.stop_token_id = self.stop_reason
        return t

    @classmethod
    def from_token_pb(cls, t: pb.Token) -> TokenEvent:
        """The token's own fields back (the request's fields are the stream message's)."""
        return cls(
            token_id=t.token_id,
            text=t.text,
            elapsed_ms=t.elapsed_ms,
            finish_reason=FinishReason.from_pb(t.finish_reason),
            usage=Usage.from_pb(t.usage) if t.HasField("usage") else None,
            logprobs=Logprobs.from_pb(t.logprobs) if t.HasField("logprobs") else None,
            index=t.index,
            stop_reason=stop_reason_of(t),
        )


def stop_reason_of(t: pb.Token) -> str | int | None:
    """A Token message's stop reason: its stop string, its stop token's id, or None."""
    which = t.WhichOneof("stop_reason")
    return None if which is None else getattr(t, which)


def fill_stream_pb(events: Sequence[TokenEvent], msg, arrival_codes: Mapping[ArrivalState, int]):
    """Write `events`, in order, into `msg`: one GenerateResponse of the worker's or the router's API
    (they share `tokens` and the request's fields; each hop has its own arrival-state enum, given by
    `arrival_codes`). Only `events[0]` may carry the request's fields (the stream's first token)."""
    if not events:
        raise ValueError("a stream message holds at least one token")
    first = events[0]
    if any(ev.ttft is not None or ev.prompt_logprobs or ev.prompt_token_ids or ev.worker for ev in events[1:]):
        raise ValueError("only the first token of a stream message may carry the request's ttft/worker/echo")
    msg.tokens.extend(ev.token_pb() for ev in events)
    if first.ttft is not None:
        msg.ttft.CopyFrom(first.ttft.to_pb())
        msg.arrival_state = arrival_codes[first.arrival or ArrivalState.BASE]
    msg.prompt_logprobs.extend(lp.to_pb() for lp in first.prompt_logprobs)
    msg.prompt_token_ids.extend(first.prompt_token_ids)
    return msg


def events_of_stream_pb(msg, arrival_of: Mapping[int, ArrivalState]) -> list[TokenEvent]:
    """`fill_stream_pb` read back: the message's tokens as events, the request's fields (ttft,
    arrival, the router's worker, prompt logprobs and ids) on the first."""
    events = [TokenEvent.from_token_pb(t) for t in msg.tokens]
    if not events:
        return events
    first = msg.HasField("ttft")
    events[0] = dataclasses.replace(
        events[0],
        ttft=Ttft.from_pb(msg.ttft) if first else None,
        arrival=arrival_of.get(msg.arrival_state, ArrivalState.BASE) if first else None,
        worker=getattr(msg, "worker", ""),
        prompt_logprobs=tuple(Logprobs.from_pb(lp) for lp in msg.prompt_logprobs),
        prompt_token_ids=tuple(msg.prompt_token_ids),
    )
    return events
