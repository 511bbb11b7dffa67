"""The OpenAI wire format's requests and their mapping to SamplingParams (responses.py: replies).

Requests are validated strictly (a string where a number belongs is a 400, not
a silent coercion); unknown fields are dropped and named (validation.RequestModel).
Every field has a type from `validation` (64-bit ints, finite floats, text
without lone surrogates, bounded lists); range checks live in one place,
`SamplingParams.validate`, so the server, the offline API and the CLI reject
exactly the same values.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationInfo,
    model_validator,
)

from pagedkv.engine.chat import TEXT_PART_KEYS, content_text
from pagedkv.engine.request import (
    INT64_MAX,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
    ParamError,
    RepetitionDetection,
    SamplingParams,
)
from pagedkv.server.request_fields import (
    UNSUPPORTED,
    NamedToolChoice,
    ResponseFormat,
    ToolCall,
    ToolDefinition,
    reject_unsupported,
    structured_spec,
)
from pagedkv.server.validation import (
    MAX_MESSAGES,
    MAX_PROMPTS,
    FiniteFloat,
    Int64,
    Name,
    RequestModel,
    SafeStr,
    TokenId,
    check_text,
    note_ignored,
)
from pagedkv.server.validation import documented as doc

Prompt = str | list[int]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PromptText = Annotated[SafeStr, Field(min_length=1)]
PromptBatch = Annotated[list[PromptText | TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
PromptInput = PromptText | TokenIds | PromptBatch  # for the schema; check_prompts reads it
StopText = Annotated[SafeStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopInput = StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None
Count = Annotated[Int64, doc(minimum=1)]
Penalty = Annotated[FiniteFloat, doc(minimum=-2, maximum=2)]
# -1: the whole vocabulary; the server's --max-logprobs (20 by default) caps them
NumLogprobs = Annotated[Int64, doc(minimum=-1)]
RepetitionPenalty = Annotated[
    FiniteFloat, doc(minimum=REPETITION_PENALTY_RANGE[0], maximum=REPETITION_PENALTY_RANGE[1])
]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # vLLM's

# the scoring routes (server/scoring.py), as vLLM serves them (Jina's and Cohere's clients too),
# and the classifier's (server/classify.py)
SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
CLASSIFY_PATHS = ("/classify", "/v1/classify")


def _is_token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int for t in v)


def check_prompts(v: Any, info: ValidationInfo) -> list[Prompt]:
    """A string, a list of token ids, or a batch of either (a completion's prompt, an embedding
    request's input).

    Returns a non-empty list of non-empty prompts."""
    name = info.field_name or "prompt"
    if isinstance(v, str) or _is_token_ids(v):
        prompts = [v]
    elif isinstance(v, list) and v and all(isinstance(p, str) or _is_token_ids(p) for p in v):
        prompts = v
    else:
        raise ValueError(f"{name} must be a string, a list of token ids, or a list of those")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"{name} takes at most {MAX_PROMPTS} prompts in one request")
    if any(len(p) == 0 for p in prompts):
        raise ValueError(f"{name} must not be empty")
    for p in prompts:
        check_text(p, name)
        if not isinstance(p, str) and not all(0 <= t <= INT64_MAX for t in p):
            raise ValueError(f"{name} token ids must be integers in [0, 2**63)")
    return prompts


def _check_stop(v: Any) -> list[str] | None:
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise ValueError("stop must be a string or a list of strings")
    for s in stops:
        check_text(s, "stop")
    return stops


StopField = Annotated[
    list[str] | None, BeforeValidator(_check_stop, json_schema_input_type=StopInput)
]


def _check_content(v: Any, info: ValidationInfo) -> str | list[dict[str, str]] | None:
    """OpenAI content: a string or a list of parts; only text parts are supported, kept as
    parts for a template that takes them (engine/chat.py: shaped_content)."""
    if isinstance(v, list):
        check_text(content_text(v), "content")  # a ConfigError (a ValueError) names the fault
        for part in v:
            note_ignored(info, "messages[].content[].", part.keys() - TEXT_PART_KEYS)
        return [{"type": "text", "text": part["text"]} for part in v]
    if v is not None and not isinstance(v, str):
        raise ValueError("content must be a string or a list of text parts")
    check_text(v, "content")
    return v


class TextPart(BaseModel):
    """Only for the schema: what a content part looks like."""

    type: Literal["text"]
    text: SafeStr


ContentInput = SafeStr | list[TextPart] | None


class StreamOptions(RequestModel):
    where = "stream_options."
    nullable = frozenset({"include_usage", "continuous_usage_stats"})
    include_usage: bool = True  # as vLLM: `stream_options: {}` asks for the usage chunk
    continuous_usage_stats: bool = False  # vLLM's; not implemented: a 400 when true


class RepetitionDetectionField(RequestModel):
    """vLLM's repetition_detection (engine/request.py: RepetitionDetection)."""

    where = "repetition_detection."
    max_pattern_size: Int64 = 0
    min_pattern_size: Int64 = 0
    min_count: Int64 = 0


class _SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    nullable = frozenset({"n", "stream", "echo"})
    model: Name | None = None
    n: Count = 1
    temperature: Annotated[FiniteFloat, doc(minimum=0, maximum=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[FiniteFloat, doc(exclusiveMinimum=0, maximum=1)] | None = None
    top_k: Annotated[Int64, doc(minimum=-1)] | None = None
    min_p: Annotated[FiniteFloat, doc(minimum=0, maximum=1)] | None = None
    seed: Int64 | None = None
    stop: StopField = None
    stop_token_ids: Annotated[list[TokenId], doc(maxItems=MAX_STOP_TOKEN_IDS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[Int64, doc(minimum=0)] = 0
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[Name, FiniteFloat] | None = None  # token id (as a string) -> bias
    user: Name | None = None
    # ---- vLLM's extensions (request_fields.py): honoured, or a 400 naming the field;
    # ranges and sizes are checked by SamplingParams.validate, as for every other field
    echo: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[SafeStr] | None = None
    prompt_logprobs: NumLogprobs | None = None
    truncate_prompt_tokens: Int64 | None = None
    cache_salt: SafeStr | None = None  # only requests with the same salt share cached blocks
    return_token_ids: bool | None = None  # token ids beside the text (prompt's and output's)
    priority: Int64 = 0  # with --scheduling-policy priority: lower runs first
    request_id: Name | None = None
    return_tokens_as_token_ids: bool | None = None  # None: --return-tokens-as-token-ids
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: dict | SafeStr | None = None
    guided_regex: SafeStr | None = None
    guided_choice: list[SafeStr] | None = None
    guided_grammar: SafeStr | None = None
    guided_decoding_backend: Name | None = None
    use_beam_search: bool = False  # n beams (engine/beam_search.py)
    length_penalty: FiniteFloat = 1.0
    stream_interval: Annotated[Int64, doc(minimum=1)] | None = None  # over --stream-interval
    # with --reasoning-parser: a section that has run this many tokens is closed
    thinking_token_budget: Annotated[Int64, doc(minimum=0)] | None = None
    truncation_side: Literal["left", "right"] | None = None  # truncate_prompt_tokens' end
    # each token's logprobs of these tokens instead of the top ones
    logprob_token_ids: (
        Annotated[list[TokenId], doc(minItems=1, maxItems=MAX_LOGPROB_TOKEN_IDS)] | None
    ) = None
    repetition_detection: RepetitionDetectionField | None = None
    _unsupported = model_validator(mode="before")(reject_unsupported)
    understood = frozenset(UNSUPPORTED)

    def wire_param(self, param: str) -> str:
        """A SamplingParams field as this request spells it (chat renames some)."""
        return param

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _extension_params(self) -> dict:
        if self.include_usage and not self.stream:  # as OpenAI and vLLM answer it
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        if self.stream_options and self.stream_options.continuous_usage_stats:
            raise ParamError(
                "stream_options", "stream_options.continuous_usage_stats is not supported"
            )
        if self.stream and self.prompt_logprobs is not None:
            raise ParamError(
                "prompt_logprobs", "prompt_logprobs is not available when stream is true"
            )
        return dict(
            logit_bias=self.logit_bias,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            prompt_logprobs=self.prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            cache_salt=self.cache_salt,
            priority=self.priority,
            structured_outputs=structured_spec(self),
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            stream_interval=self.stream_interval,
            thinking_token_budget=self.thinking_token_budget,
            truncation_side=self.truncation_side,
            logprob_token_ids=self.logprob_token_ids,
            repetition_detection=(
                RepetitionDetection(**self.repetition_detection.model_dump())
                if self.repetition_detection
                else None
            ),
        )

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        def pick(value, default):
            return default if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, -1),
            min_p=pick(self.min_p, 0.0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            logprobs=logprobs,
            **self._extension_params(),
        )


class CompletionRequest(_SamplingRequest):
    prompt: Annotated[
        list[Prompt], BeforeValidator(check_prompts, json_schema_input_type=PromptInput)
    ]
    # 0 with echo: score the prompt only (its prompt logprobs), as OpenAI's legacy API and vLLM
    max_tokens: Annotated[Int64, doc(minimum=0)] | None = 16
    logprobs: NumLogprobs | None = None
    best_of: Count | None = None
    suffix: SafeStr | None = None
    add_special_tokens: bool = True

    @property
    def echo_only(self) -> bool:
        """The prompt alone comes back (with its logprobs when asked): nothing generated."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        if self.stream and self.echo and self.logprobs is not None:
            raise ParamError("echo", "echo with logprobs is not available when stream is true")
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", "best_of other than n is not supported")
        if self.max_tokens == 0:
            if not self.echo:
                raise ParamError(
                    "max_tokens",
                    "max_tokens must be at least 1, or 0 with echo to score the prompt",
                )
            if self.min_tokens:
                raise ParamError("min_tokens", "min_tokens must be 0 when max_tokens is 0")
        # echo_only: the engine samples one token, which the response leaves out
        params = self._params(1 if self.echo_only else self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens get logprobs too
            params.prompt_logprobs = max(params.prompt_logprobs or 0, self.logprobs)
        return params


class ChatMessage(RequestModel):
    where = "messages[]."
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[
        str | list[dict[str, str]] | None,
        BeforeValidator(_check_content, json_schema_input_type=ContentInput),
    ] = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Name | None = None
    # an earlier answer's reasoning, as a client sends it back (vLLM's name and the older one)
    reasoning: SafeStr | None = None
    reasoning_content: SafeStr | None = None

    def as_template_input(self) -> dict:
        """What the chat template sees; tool call arguments as objects, as HF templates expect,
        and an earlier answer's reasoning as `reasoning_content`, the name templates read."""
        msg: dict = {"role": self.role, "content": self.content or ""}  # parts stay parts
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments_object(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        return msg


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        raise ParamError(
            "messages", f"tool call arguments are not JSON: {arguments[:80]!r}"
        ) from None


class ChatForm(RequestModel):
    """A request that comes as text (its field `text_field`) or as a conversation, rendered with
    the chat template (tools.chat_prompt) by vLLM's fields for it: exactly one of the two."""

    text_field: ClassVar[str]
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for text, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: SafeStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    documents: list[dict] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> ChatForm:
        if (getattr(self, self.text_field) is None) == (self.messages is None):
            raise ValueError(f"give exactly one of {self.text_field} and messages")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self

    def special_tokens(self) -> bool:
        """Whether encoding adds the tokenizer's special tokens (a template has its own)."""
        if self.messages is None:
            return self.add_special_tokens is not False
        return bool(self.add_special_tokens)


class ChatCompletionRequest(_SamplingRequest):
    nullable = _SamplingRequest.nullable | {"logprobs"}
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    # ---- chat template and tools (vLLM's fields)
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: SafeStr | None = None
    chat_template_kwargs: dict | None = None
    documents: list[dict] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # false: the answer without its reasoning (--reasoning-parser)
    # as vLLM: the chat template's `reasoning_effort`, and its `enable_thinking` (false for
    # "none") unless chat_template_kwargs sets that
    reasoning_effort: ReasoningEffort | None = None
    return_prompt_text: bool | None = None  # the templated prompt in the answer (vLLM's)
    best_of: Count | None = None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.logprob_token_ids is not None and not self.logprobs:
            raise ParamError("logprob_token_ids", "logprob_token_ids requires logprobs to be true")
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", "best_of other than n is not supported")
        limit = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        try:
            return self._params(limit, (self.top_logprobs or 0) if self.logprobs else None)
        except ParamError as e:
            e.rename(self.wire_param(e.param))
            raise

    def wire_param(self, param: str) -> str:
        """A SamplingParams field as this request spells it."""
        if param == "logprobs":
            return "top_logprobs"
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return param
