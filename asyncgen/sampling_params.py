"""How to sample one request: :class:`SamplingParams` (vLLM's field names and defaults)."""

from __future__ import annotations

import functools
import json as _json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

from .structured import unicode_problem

__all__ = ["BeamSearchParams", "SamplingParams", "StructuredOutputsParams"]

_MAX_LOGPROBS = 20
_GREEDY_BELOW = 1e-5  # temperatures below this sample the argmax (as vLLM does)
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1  # a seed is a signed 64-bit integer


def _conflict(field: str, message: str) -> PydanticCustomError:
    """The error of a value that another field rules out: pydantic gives a whole-model
    check no location, so the field it blames travels in the error's context
    (``ctx["field"]``), where the OpenAI layer reads it."""
    return PydanticCustomError("invalid_combination", message, {"field": field})


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class StructuredOutputsParams:
    """Constrains a request's output (vLLM's ``StructuredOutputsParams``); set exactly one:

    * ``json``: a JSON Schema (a dict, or its JSON text, e.g. ``Model.model_json_schema()``
      of a pydantic model): the output is one JSON value that satisfies it. Object
      properties come in the schema's order and no others are allowed (OpenAI's strict
      mode); the keywords :mod:`asyncgen.structured` does not enforce are refused.
    * ``json_object=True``: the output is a JSON object (OpenAI's JSON mode).
    * ``choice``: the output is exactly one of these strings.
    * ``regex``: the output is text that the regular expression matches in whole (the
      JSON Schema ``pattern`` dialect; :mod:`asyncgen.regex` lists the syntax).
    * ``structural_tag``: free text in which each structure that a trigger opens must be
      complete and its JSON satisfy its schema (vLLM's ``{"type": "structural_tag",
      "structures": [{"begin", "schema", "end"}], "triggers": [...]}``, a dict or its
      JSON text; :func:`asyncgen.structured.structural_tag_grammar` has the rules).
      Tool calls with ``strict`` in ``tool_choice="auto"`` are generated this way.

    The output ends, with the request's stop token, once it is complete (a structural
    tag's output ends where the model ends it, outside a structure); it may still be cut
    short by ``max_tokens`` (finish reason "length") or a stop string. The schema is
    compiled when the params are made, so an unsupported or malformed one raises
    pydantic's ``ValidationError`` there, naming the keyword and where it is.
    """

    json: Optional[Union[dict[str, Any], bool, str]] = None
    json_object: Optional[bool] = None
    choice: Optional[list[str]] = None
    regex: Optional[str] = None
    structural_tag: Optional[Union[dict[str, Any], str]] = None

    def __post_init__(self):
        given = [name for name in _KINDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"set exactly one of {', '.join(_KINDS)} (got {given or 'none'})")
        if self.json_object is False:
            raise ValueError("json_object must be True when given")
        for name in ("json", "structural_tag"):
            text = getattr(self, name)
            if isinstance(text, str):
                try:
                    object.__setattr__(self, name, _json.loads(text))
                except ValueError as e:
                    raise ValueError(f"{name} is not valid JSON text: {e}") from None
        self.grammar  # compile now: a bad schema fails at construction

    @property
    def key(self) -> str:
        """The constraint as canonical text (property order kept: it is part of the grammar)."""
        return _json.dumps({name: getattr(self, name) for name in _KINDS})

    @property
    def free_text(self) -> bool:
        """Whether the output is free text around its structures (a structural tag), not
        one constrained value: it may hold a reasoning block the prompt opened."""
        return self.structural_tag is not None

    @property
    def grammar(self):
        """The compiled :class:`asyncgen.structured.Grammar` (cached by :attr:`key`)."""
        return _compile(self.key)


_KINDS = ("json", "json_object", "choice", "regex", "structural_tag")


@functools.lru_cache(maxsize=256)
def _compile(key: str):
    from . import structured

    spec = _json.loads(key)
    if spec["structural_tag"] is not None:
        return structured.structural_tag_grammar(spec["structural_tag"])
    if spec["json"] is not None:
        return structured.json_schema_grammar(spec["json"])
    if spec["json_object"]:
        return structured.json_object_grammar()
    if spec["regex"] is not None:
        return structured.regex_grammar(spec["regex"])
    return structured.choice_grammar(spec["choice"])


class SamplingParams(BaseModel):
    """Sampling settings of one request, validated once at construction.

    ``temperature=0`` means greedy, as does any temperature below 1e-5 (dividing the
    logits by it could overflow). ``top_k`` of 0 or -1 and ``top_p=1`` disable those
    filters. Penalties follow their usual definitions: ``repetition_penalty`` divides
    positive (multiplies negative) logits of every token seen in the prompt or output;
    ``presence_penalty`` and ``frequency_penalty`` subtract from logits of tokens in the
    output (OpenAI's definitions). ``max_tokens=None`` means "up to ``max_model_len``"
    (or to what the KV pool holds for one sequence, if that is less). ``min_tokens``
    keeps stop tokens and stop strings from ending a completion before that many tokens.
    ``best_of`` (>= ``n``) samples that many sequences and returns the ``n`` with the
    highest cumulative logprob (``generate()`` only: the choice is made at the end).
    ``structured_outputs`` constrains the output to a JSON Schema, any JSON object, a
    list of choices, a regular expression or structures within free text
    (:class:`StructuredOutputsParams`); logprobs
    are then those of the model before the constraint masks the tokens it rules out.
    ``allowed_token_ids`` (vLLM's) lets only those tokens be sampled; ``bad_words`` (vLLM's)
    keeps each word out of the output: the token that would complete it, as the word or
    as " word" tokenizes, is masked wherever the output ends with the tokens before it.
    Both mask after the logprobs are taken, as structured outputs do.
    ``truncate_prompt_tokens=k`` (vLLM's) keeps only the prompt's last ``k`` tokens (-1:
    ``max_model_len``; more than that is refused); without it a prompt too long is refused.
    ``seed`` (a signed 64-bit integer) makes the request's sampling repeatable, whatever
    else the engine runs beside it (on the CPU, torch's generator reads only a seed's low
    32 bits).
    Invalid values raise pydantic's ``ValidationError`` naming the field; where a value is
    refused because of another field's, the error's ``ctx["field"]`` names the one refused.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    n: Annotated[int, Field(ge=1, le=256)] = 1
    best_of: Optional[Annotated[int, Field(ge=1, le=256)]] = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: Optional[dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]]] = None
    seed: Optional[Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = None
    ignore_eos: bool = False
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = 16
    min_tokens: Annotated[int, Field(ge=0)] = 0
    logprobs: Optional[Annotated[int, Field(ge=0, le=_MAX_LOGPROBS)]] = None
    prompt_logprobs: Optional[Annotated[int, Field(ge=0, le=_MAX_LOGPROBS)]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Optional[StructuredOutputsParams] = None
    allowed_token_ids: Optional[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[Annotated[int, Field(ge=-1)]] = None

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, v):
        if v is None:
            return v
        strings = [v] if isinstance(v, str) else v
        if any(s == "" for s in strings):
            raise ValueError("stop strings must not be empty")
        for s in strings:
            if (problem := unicode_problem(s)) is not None:
                raise ValueError(f"stop string {s!r}: {problem}")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_to_some(cls, v):
        if v == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1 (0 would leave no prompt)")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words_not_blank(cls, v):
        if v is not None and any(not w.strip() for w in v):
            raise ValueError("bad_words must not hold empty or blank strings")
        for w in v or ():
            if (problem := unicode_problem(w)) is not None:
                raise ValueError(f"bad word {w!r}: {problem}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, v):
        if v is not None and any(k < 0 for k in v):
            raise ValueError("logit_bias keys must be token ids >= 0")
        return v

    @model_validator(mode="after")
    def _best_of_ge_n(self):
        if self.best_of is not None and self.best_of < self.n:
            raise _conflict("best_of", f"best_of ({self.best_of}) must be >= n ({self.n})")
        return self

    @model_validator(mode="after")
    def _structured_outputs_end(self):
        if self.structured_outputs is not None and self.allowed_token_ids is not None:
            raise _conflict("allowed_token_ids", "allowed_token_ids cannot be combined with structured_outputs: "
                            "the constraint decides which tokens may come next")
        if self.structured_outputs is not None and not self.structured_outputs.free_text:
            if self.ignore_eos:
                raise _conflict("ignore_eos", "ignore_eos=True cannot be combined with structured_outputs: the "
                                "constraint ends the output with the stop token once it is complete")
            if self.min_tokens:
                raise _conflict("min_tokens", "min_tokens cannot be combined with structured_outputs: the "
                                "constraint decides when the output is complete")
        return self

    @property
    def num_sequences(self) -> int:
        """Sequences generated: ``best_of`` when set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @model_validator(mode="after")
    def _min_le_max(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _conflict("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (empty when unset)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW


class BeamSearchParams(BaseModel):
    """Settings of :meth:`asyncgen.AsyncEngine.beam_search` (vLLM's ``BeamSearchParams``
    fields, with transformers' ``early_stopping``).

    ``beam_width`` (at most 10) sequences are kept at each step: the most likely continuations of the
    current ones by cumulative logprob. A continuation ending in the end-of-sequence token
    (unless ``ignore_eos``) is finished with the score ``cumulative_logprob /
    length ** length_penalty`` (length: its generated tokens, that token included); after
    ``max_tokens`` steps the running sequences are scored the same way and the
    ``beam_width`` best of all are returned. ``early_stopping`` (transformers' meaning):
    True stops once ``beam_width`` sequences are finished; False (the default) also stops
    when none running can score better than the worst of them at its current length;
    "never" judges that at ``max_tokens`` when ``length_penalty > 0``. ``max_tokens=None``
    means as many as fit, as in :class:`SamplingParams`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    beam_width: Annotated[int, Field(ge=1, le=_MAX_LOGPROBS // 2)]
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = 16
    ignore_eos: bool = False
    length_penalty: Annotated[float, Field(allow_inf_nan=False)] = 1.0
    early_stopping: Union[bool, Literal["never"]] = False

