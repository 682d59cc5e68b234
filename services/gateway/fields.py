"""The gateway's request surface: every field a client of OpenAI's or vLLM's server may send, and what
this gateway does with it. The one allowlist: `protocol` refuses anything not honoured or ignored
here (400 `unsupported_parameter` naming the field), and docs/gateway.md's field table is this
module's `table()` (a test checks they are equal; `python -m services.gateway.fields` prints it).

- honoured: it changes the answer as it would on OpenAI's or vLLM's server;
- ignored: harmless to drop (it changes nothing a client reads back);
- refused: 400, unless the value is null or one that means "off" (`off`: e.g. `n: 1`, `echo: false`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Use(enum.Enum):
    HONOURED = "honoured"
    IGNORED = "ignored"
    REFUSED = "refused (400)"


HON, IGN, REF = Use.HONOURED, Use.IGNORED, Use.REFUSED


@dataclass(frozen=True)
class Field:
    name: str
    completion: Use | None  # None: not a field of that endpoint (refused like any unknown field)
    chat: Use | None
    origin: str  # "OpenAI" or "vLLM" (vLLM's extra sampling and request fields)
    note: str = ""
    off: tuple = ()  # refused fields: values that mean "not used" and so pass

    def use(self, kind: str) -> Use | None:
        return self.completion if kind == "completion" else self.chat


MAX_PROMPTS = 64  # prompts in one completions request (each its own generation; the body's size bounds them too)
GUIDED = "the output constrained by its grammar (docs/structured-output.md); one constraint per request"
GEN = "unset: the model's generation config's (`--generation-config`)"  # docs/gateway.md, "Sampling defaults"
RAW = "from the model's raw logits (before penalties, bias, masks, temperature: vLLM's raw_logprobs)"
FIELDS: tuple[Field, ...] = (
    # -- OpenAI's --------------------------------------------------------------------------------------
    Field("model", HON, HON, "OpenAI", "the base or a variant (`/v1/models`)"),
    Field(
        "prompt",
        HON,
        None,
        "OpenAI",
        f"a string, token ids, or a list of up to {MAX_PROMPTS} of either (choice k·n + i: prompt k's i-th)",
    ),
    Field(
        "messages",
        None,
        HON,
        "OpenAI",
        "text content (a string or text parts; an image part: 400), rendered with the chat template; parts "
        "reach it as vLLM hands them over (`--chat-template-content-format`)",
    ),
    Field(
        "max_tokens",
        HON,
        HON,
        "OpenAI",
        "beyond the context the prompt leaves: 400 naming both; chat's " + GEN + ", cut to the context",
    ),
    Field("max_completion_tokens", None, HON, "OpenAI", "as max_tokens"),
    Field("temperature", HON, HON, "OpenAI", "0–2; 0 is greedy; " + GEN),
    Field("top_p", HON, HON, "OpenAI", "(0, 1]; " + GEN),
    Field("stop", HON, HON, "OpenAI", "a string or up to 4 (not returned)"),
    Field("seed", HON, HON, "OpenAI", "same seed, same text, whatever else is batched"),
    Field("stream", HON, HON, "OpenAI", "server-sent events"),
    Field(
        "stream_options",
        HON,
        HON,
        "OpenAI",
        "`include_usage` (a boolean); vLLM's `continuous_usage_stats`: with include_usage, every chunk's usage is its"
        " prompt's tokens and its choice's so far",
    ),
    Field("n", HON, HON, "OpenAI", "1–16 choices sharing one prefill; a seeded request's are reproducible"),
    Field(
        "logprobs",
        HON,
        HON,
        "OpenAI",
        RAW + "; completions: 0–20 alternatives (0: the sampled token's), chat: true/false",
    ),
    Field("top_logprobs", None, HON, "OpenAI", "0–20 alternatives, with logprobs: true"),
    Field(
        "echo",
        HON,
        HON,
        "OpenAI / vLLM (chat)",
        "completions: the prompt before the text; with logprobs, its tokens' first (the first one's null)."
        " Chat (vLLM's): the last message's content before the answer when it has the answer's role"
        " (assistant after a generation prompt, else the last message's); not with tools",
    ),
    Field("best_of", REF, None, "OpenAI", "best_of > 1: not served", off=(1,)),
    Field("suffix", REF, None, "OpenAI", "insertion: not served", off=("",)),
    Field("logit_bias", HON, HON, "OpenAI", "token id (a string) → bias, -100 to 100, added to the raw logits"),
    Field("presence_penalty", HON, HON, "OpenAI", "-2 to 2, minus this for every token the output holds"),
    Field("frequency_penalty", HON, HON, "OpenAI", "-2 to 2, minus this times the token's count in the output"),
    Field(
        "response_format",
        HON,
        HON,
        "OpenAI",
        "`text`, `json_object`, `json_schema` {name, schema, strict}: enforced by a grammar, strict or not"
        " (docs/structured-output.md)",
    ),
    Field(
        "tools",
        None,
        HON,
        "OpenAI",
        "function definitions, rendered by the chat template; calls parsed into `tool_calls` (Hermes `<tool_call>`,"
        " Llama 3.1 JSON, Mistral `[TOOL_CALLS]`, Granite `<|tool_call|>`, Phi-4-mini `functools[...]`)"
        " (docs/structured-output.md)",
    ),
    Field(
        "tool_choice",
        None,
        HON,
        "OpenAI",
        "`none`, `auto`, `required` or a named function: `required` and named enforced by a grammar of the calls",
    ),
    Field("parallel_tool_calls", None, HON, "OpenAI", "`false`: `required` makes exactly one call"),
    Field("functions", None, REF, "OpenAI", "deprecated: use tools", off=([],)),
    Field("function_call", None, REF, "OpenAI", "deprecated: use tool_choice", off=("none",)),
    Field("audio", None, REF, "OpenAI", "text only"),
    Field("modalities", None, REF, "OpenAI", "text only", off=(["text"],)),
    Field("prediction", None, REF, "OpenAI", "predicted outputs: not served"),
    Field("reasoning_effort", None, REF, "OpenAI", "not a reasoning model"),
    Field("verbosity", None, REF, "OpenAI", "not served"),
    Field("web_search_options", None, REF, "OpenAI", "not served"),
    Field("prompt_cache_key", None, IGN, "OpenAI", "a cache hint"),
    Field("safety_identifier", None, IGN, "OpenAI", "an end-user id for abuse checks"),
    Field("user", IGN, IGN, "OpenAI", "an end-user id"),
    Field("metadata", IGN, IGN, "OpenAI", "stored-completion tags"),
    Field("store", IGN, IGN, "OpenAI", "nothing is stored"),
    Field("service_tier", IGN, IGN, "OpenAI", "one tier"),
    # -- vLLM's extra fields ---------------------------------------------------------------------------
    Field("top_k", HON, HON, "vLLM", "the k most likely tokens; -1 or 0: all; " + GEN),
    Field("min_p", HON, HON, "vLLM", "tokens at least min_p × as likely as the most likely; 0: all; " + GEN),
    Field(
        "repetition_penalty",
        HON,
        HON,
        "vLLM",
        "prompt and output tokens: logit / p if positive, else × p (transformers' rule); " + GEN,
    ),
    Field("stop_token_ids", HON, HON, "vLLM", "end on these tokens (finish_reason stop; their text not returned)"),
    Field("min_tokens", HON, HON, "vLLM", "no EOS, stop token or stop string before this many tokens"),
    Field("ignore_eos", HON, HON, "vLLM", "EOS does not end the answer"),
    Field("include_stop_str_in_output", HON, HON, "vLLM", "the stop string (or stop token's text) is returned too"),
    Field(
        "prompt_logprobs",
        HON,
        HON,
        "vLLM",
        "0–20: each prompt token's logprob and rank, and this many alternatives, from the raw logits, in the"
        " whole answer (completions: each choice of the prompt; chat: the response); with stream: 400 (vLLM"
        " returns none there)",
    ),
    Field("use_beam_search", REF, REF, "vLLM", "beam search: not served", off=(False,)),
    Field("length_penalty", REF, REF, "vLLM", "beam search: not served", off=(1, 1.0)),
    Field("allowed_token_ids", HON, HON, "vLLM", "only these tokens may be picked (not with a constraint)"),
    Field(
        "bad_words",
        HON,
        HON,
        "vLLM",
        "the token completing one is masked once the output ends with the rest (not with a constraint)",
    ),
    Field(
        "skip_special_tokens",
        HON,
        HON,
        "vLLM",
        "false: special tokens' text stays in the output (EOS's only with include_stop_str_in_output)",
    ),
    Field(
        "return_token_ids",
        HON,
        HON,
        "vLLM",
        "`token_ids` of each choice, and `prompt_token_ids` as the worker ran it (completions: each choice;"
        " chat: the response); streamed, each chunk its tokens' and the first the prompt's",
    ),
    Field(
        "spaces_between_special_tokens",
        IGN,
        IGN,
        "vLLM",
        "only vLLM's slow tokenizers read it; a tokenizer.json (the only kind served) decodes alike either way",
    ),
    Field(
        "truncate_prompt_tokens",
        HON,
        HON,
        "vLLM",
        "the prompt's last k tokens; -1: as many as the context leaves for max_tokens (unset: too long is 400)",
    ),
    Field(
        "add_special_tokens",
        HON,
        HON,
        "vLLM",
        "the tokenizer's special tokens (BOS) added to a text prompt; default true (completions), false (chat:"
        " the template writes its own); token-id prompts are used as they are",
    ),
    Field(
        "add_generation_prompt", None, HON, "vLLM", "default true: the template's assistant header after the messages"
    ),
    Field(
        "continue_final_message",
        None,
        HON,
        "vLLM",
        "the prompt ends inside the last message, after its text (needs add_generation_prompt false)",
    ),
    Field("chat_template", None, REF, "vLLM", "the gateway's templates only (`--chat-template`)"),
    Field(
        "chat_template_kwargs",
        None,
        HON,
        "vLLM",
        "variables for the chat template (e.g. Qwen3's enable_thinking); not its own names",
    ),
    Field(
        "include_reasoning",
        None,
        HON,
        "vLLM",
        "with `--reasoning-parser`: false leaves the thinking out (`reasoning` null); default true",
    ),
    Field(
        "documents",
        None,
        HON,
        "vLLM",
        "objects of string fields for a RAG template (Command R's, Granite's `documents`); 400 where the "
        "model's template does not read them",
    ),
    Field("mm_processor_kwargs", None, REF, "vLLM", "text only"),
    Field("guided_json", HON, HON, "vLLM", "a JSON schema (an object or its JSON text): " + GUIDED),
    Field("guided_regex", HON, HON, "vLLM", "the whole output matches it: " + GUIDED),
    Field("guided_choice", HON, HON, "vLLM", "the output is one of these strings: " + GUIDED),
    Field("guided_grammar", HON, HON, "vLLM", "Lark (llguidance's) or GBNF (with `::=`): " + GUIDED),
    Field(
        "structured_outputs",
        HON,
        HON,
        "vLLM",
        "one of `json`, `regex`, `choice`, `grammar`, `json_object: true` (as the guided_* fields)",
    ),
    Field("guided_decoding_backend", IGN, IGN, "vLLM", "one backend: llguidance"),
    Field("guided_whitespace_pattern", REF, REF, "vLLM", "JSON's layout is fixed (docs/structured-output.md)"),
    Field("structural_tag", None, REF, "vLLM", "not served: the tools' grammar is built from `tools`"),
    Field("logits_processors", REF, REF, "vLLM", "no code from requests"),
    Field(
        "return_tokens_as_token_ids",
        HON,
        HON,
        "vLLM",
        'logprobs name each token "token_id:N" (text_offset still counts the text)',
    ),
    Field(
        "priority",
        HON,
        HON,
        "vLLM",
        "an integer, lower first, FIFO within one value (0 by default): orders the router's queue and each "
        "worker's admission; a worse one running is preempted (recomputed later) for a better one waiting",
    ),
    Field("request_id", IGN, IGN, "vLLM", "the gateway makes its own"),
    Field("cache_salt", HON, HON, "vLLM", "a string: only requests with the same salt share prefix-cached KV blocks"),
    Field("kv_transfer_params", REF, REF, "vLLM", "not served"),
    Field("vllm_xargs", REF, REF, "vLLM", "not served"),
)
BY_NAME = {f.name: f for f in FIELDS}


def table() -> str:
    """The markdown table of docs/gateway.md: every field, what each endpoint does with it."""
    cell = {None: "—", HON: "**honoured**", IGN: "ignored", REF: "refused (400)"}
    rows = [
        "| field | from | `/v1/completions` | `/v1/chat/completions` | note |",
        "|---|---|---|---|---|",
    ]
    for f in FIELDS:
        rows.append(f"| `{f.name}` | {f.origin} | {cell[f.completion]} | {cell[f.chat]} | {f.note} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
