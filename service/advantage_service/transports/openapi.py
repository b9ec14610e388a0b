"""The OpenAPI document of the HTTP transport: models, schemas generated from the estimator
registry, documented responses, and the request body (JSON and Arrow) with computed examples.

The models exist for documentation only: the hot path never builds them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from advantage_contract import arrow as contract_arrow
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, create_model

from ..estimators import OUTCOMES, TERMS, Param, presets
from ..estimators.pipeline import all_diagnostics
from ..estimators.spec import DEFAULT_PRESET, TOP_LEVEL_PARAMS
from ..serving.compute import compute as compute_in_process
from ..wire import jsonio

JSON = "application/json"
ARROW = contract_arrow.MEDIA_TYPE
REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    code: str = Field(description="stable machine-readable word, e.g. invalid_type")
    message: str = Field(description="what is wrong, naming the value")
    group_id: str | None = Field(None, description="the group of the offending value")
    rollout_index: int | None = Field(None, description="the rollout's index within its group")
    field: str | None = Field(None, description="the offending field, e.g. reward, logprobs")
    retry_after_ms: int | None = Field(
        None,
        description="overloaded only: milliseconds to wait before retrying, sized from the "
        "rate the queue drains at",
    )


class ErrorResponse(BaseModel):
    error: ErrorDetail

    model_config = ConfigDict(
        json_schema_extra={
            "example": {
                "error": {
                    "code": "length_mismatch",
                    "message": "logprobs has 2 values for 3 tokens",
                    "group_id": "prompt-17",
                    "rollout_index": 0,
                    "field": "logprobs",
                }
            }
        }
    )


TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
LogProb = Annotated[float, Field(le=0.0)]
Entropy = Annotated[float, Field(ge=0.0)]
SumPiSquared = Annotated[float, Field(gt=0.0, le=1.0)]
Weight = Annotated[float, Field(ge=0.0)]
PlanningFlag = Annotated[float, Field(ge=0.0, le=1.0)]


class RolloutIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[TokenId] = Field(description="token ids of the completion")
    reward: Annotated[float, Field(allow_inf_nan=False)] | None = Field(
        None,
        description="verifier reward; correct means reward > 0. Required unless the rollout "
        "gives reward_components",
    )
    logprobs: list[LogProb] | None = Field(
        None, description="the policy's log-probability of each token (one per token)"
    )
    entropy: list[Entropy] | None = Field(
        None,
        description="the entropy (nats) of the policy's next-token distribution where each "
        "token was sampled (one per token; forking needs it)",
    )
    sum_pi_squared: list[SumPiSquared] | None = Field(
        None,
        description="sum over the vocabulary of pi(v | x, y_<t)^2 at each token (one per "
        "token; otb needs it)",
    )
    is_weights: list[Weight] | None = Field(
        None,
        description="the trainer's truncated importance weights (one per token; otb uses them "
        "when given)",
    )
    returns: list[float] | None = Field(
        None,
        description="the return from each token on (the reward-to-go of rewards spread over "
        "tokens; one per token; otb uses it in place of the reward when given)",
    )
    planning_mask: list[PlanningFlag] | None = Field(
        None,
        description="1 on the planning tokens hicra amplifies, 0 elsewhere (one per token; "
        "hicra needs it unless the server has a tokenizer to find strategic phrases)",
    )
    teacher_logprobs: dict[str, list[LogProb]] | None = Field(
        None, description="condition name (e.g. pos, neg) -> log-probabilities, one per token"
    )
    reward_components: dict[str, float | None] | None = Field(
        None,
        description="named rewards (e.g. format, accuracy; at most 16 names of at most 64 "
        "characters, the same names on every rollout of the request), null where the rollout "
        "has no value (left out of that component's statistics); with them `reward` may be "
        "left out: the sum of the components, weighted by the outcome's `weights` if it has "
        "them",
    )


class GroupIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(description="the group's (prompt's) id, unique in the request")
    prompt_key: str | None = Field(
        None,
        max_length=256,
        description="the key of the group's state kept per prompt (KTAE history); the group id "
        "when absent",
    )
    rollouts: list[RolloutIn] = Field(min_length=1)


class AdvantageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str | None = Field(None, description="echoed back; generated when absent")
    namespace: str = Field("default", min_length=1, max_length=128)
    estimator: Any = Field(None, description="a preset name or an estimator object")
    ignore_token_ids: list[int] | None = Field(
        None, description="token ids KTAE ignores (end of text, padding)"
    )
    vocab_size: int | None = Field(None, ge=1, description="token ids must be below it")
    return_: list[str] | None = Field(
        None, alias="return", description="diagnostics to return beside advantages"
    )
    groups: list[GroupIn]


class ComponentStats(BaseModel):
    mean: float | None = Field(description="null when no rollout has a value")
    std: float | None = Field(description="null when fewer than two rollouts have a value")


class Summary(BaseModel):
    tokens: int
    rollouts: int
    groups: int
    zero_signal_groups: int = Field(description="groups whose rollouts all had the same reward")
    device: str
    compute_ms: float
    history: Literal["none", "applied", "empty", "partial", "unavailable"] = Field(
        description="applied: earlier visits contributed to at least one group; empty: the "
        "read succeeded and no group had history; partial: some groups' history could not be "
        "read (part of a Redis Cluster did not answer; each group's `history` says which), the "
        "others' was; unavailable: the stats store could not be read (computed without "
        "history); none: no history asked for"
    )
    batch_requests: int = Field(
        description="requests computed together in this computation (dynamic batching; 1: "
        "alone); compute_ms is the shared computation's time"
    )
    recorded: bool | None = Field(
        description="true: the service accepted the request's statistics (history, vocabulary "
        "statistics), written after the answer; they are lost only if the stats store becomes "
        "unreachable or the process dies first, both counted in metrics. false: not accepted "
        "(the store is unreachable, or the service is shutting down). null: nothing is recorded"
    )
    reward_components: dict[str, ComponentStats] | None = Field(
        None,
        description="per reward component of the request: the mean and std (Bessel-corrected) "
        "of the rollouts' values, those without one left out; absent without components",
    )


RolloutOut = create_model(  # type: ignore[call-overload]
    "RolloutOut",
    advantages=(list[float], Field(description="per-token advantages, float32")),
    **{
        name: (
            float | None if name == "scalar" else list[float] | None,
            Field(None, description="returned when asked for in `return`"),
        )
        for name in all_diagnostics()
    },
)


class GroupOut(BaseModel):
    id: str
    rollouts: list[RolloutOut]  # type: ignore[valid-type]
    history: Literal["applied", "empty", "unavailable"] | None = Field(
        None,
        description="when the request reads history: what this group's read gave (applied: "
        "earlier visits contributed; empty: nothing stored; unavailable: not read, computed as "
        "a first visit and not written)",
    )


class AdvantageResponse(BaseModel):
    request_id: str
    namespace: str
    estimator: dict[str, Any] = Field(description="the resolved estimator object")
    groups: list[GroupOut]
    summary: Summary


class ParamInfo(BaseModel):
    name: str
    type: Literal["boolean", "number", "string", "array", "object"]
    default: Any
    description: str
    nullable: bool
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    choices: list[str] | None = None


INPUTS_DOC = (
    "rollout fields it needs on every rollout, with its default parameters (logprobs, entropy, "
    "sum_pi_squared, planning_mask, teacher_logprobs.<condition>); a request without one is "
    "refused with missing_input"
)
OPTIONAL_INPUTS_DOC = "rollout fields it reads when the request gives them"


class _MethodInfo(BaseModel):
    """What an outcome method and a term both list first (their other fields follow, in the
    listing's order)."""

    name: str
    description: str
    formula: str
    paper: str
    parameters: list[ParamInfo]


class OutcomeInfo(_MethodInfo):
    whiten_default: bool
    min_group_size: int
    per_token: bool = Field(
        description="a_it differs from token to token (true) or is the rollout's a_i (false)"
    )
    diagnostics: list[str]
    inputs: list[str] = Field(description=INPUTS_DOC)
    optional_inputs: list[str] = Field(description=OPTIONAL_INPUTS_DOC)


class TermInfo(_MethodInfo):
    diagnostics: list[str]
    inputs: list[str] = Field(description=INPUTS_DOC)
    optional_inputs: list[str] = Field(description=OPTIONAL_INPUTS_DOC)
    derived_inputs: dict[str, str] = Field(
        description="an input of `inputs` the service can make when a request lacks it -> what "
        "that takes (hicra's planning_mask: a server tokenizer)"
    )


class EstimatorListing(BaseModel):
    contract: int = Field(
        description="the contract version (fields, limits, methods) of this service; a client "
        "of another version warns"
    )
    default: str
    presets: dict[str, dict[str, Any]] = Field(description="preset name -> resolved estimator")
    outcomes: list[OutcomeInfo]
    terms: list[TermInfo]
    options: list[ParamInfo] = Field(description="estimator-level parameters (whiten, clip)")
    diagnostics: list[str] = Field(description="names a request may list in `return`")


class TokenStat(BaseModel):
    token_id: int
    correct_rollouts: int = Field(description="rollouts with reward > 0 containing the token")
    wrong_rollouts: int = Field(description="rollouts with reward <= 0 containing the token")
    occurrences: int
    key_score: float | None = Field(description="mean KTAE score where KTAE scored the token")
    mean_sensitivity: float | None = Field(description="mean CSCR sensitivity where CSCR ran")


class TokenStats(BaseModel):
    namespace: str
    rollouts_counted: int
    tokens: list[TokenStat]


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    ready: bool
    stats_store: Literal["memory", "up", "degraded", "down"] = Field(
        description="degraded: a Redis Cluster of which some masters do not answer (history "
        "of their slots is unavailable, the rest is served); down: the store does not answer"
    )
    reason: str | None = None


EXAMPLE_REQUEST: dict[str, Any] = {
    "request_id": "3f6c2a",
    "namespace": "default",
    "estimator": "ktae",
    "ignore_token_ids": [151643],
    "vocab_size": 151936,
    "return": ["scalar", "ktae_score"],
    "groups": [
        {
            "id": "prompt-17",
            "rollouts": [
                {"tokens": [9707, 11, 1879], "reward": 1.0, "logprobs": [-0.1, -2.3, -0.7]},
                {"tokens": [9707, 30], "reward": 0.0, "logprobs": [-0.2, -1.6]},
            ],
        }
    ],
}


# The bounds of a parameter as its listing gives them (Param.describe), by their JSON Schema
# names.
_SCHEMA_BOUNDS = {
    "minimum": "minimum",
    "exclusive_minimum": "exclusiveMinimum",
    "maximum": "maximum",
    "choices": "enum",
}


def param_json_schema(p: Param) -> dict[str, Any]:
    """JSON Schema of one estimator parameter, from its registry declaration."""
    kind = {bool: "boolean", float: "number", str: "string", list: "array", dict: "object"}[p.kind]
    schema: dict[str, Any] = {"type": kind, "description": p.doc}
    if p.kind is dict:  # (gdpo's weights: name -> number)
        schema["additionalProperties"] = {"type": "number"}
        schema["propertyNames"] = {"minLength": 1, "maxLength": p.max_length}
        schema["maxProperties"] = p.max_items
    if p.kind is list:
        schema["items"] = {"type": "string", "minLength": 1, "maxLength": p.max_length}
        schema["maxItems"] = p.max_items
    listed = p.describe()
    schema.update({key: listed[name] for name, key in _SCHEMA_BOUNDS.items() if name in listed})
    if p.nullable:
        schema = {"anyOf": [schema, {"type": "null"}], "description": p.doc}
    if p.default is not None or p.nullable:
        schema["default"] = p.default
    return schema


def estimator_json_schema() -> dict[str, Any]:
    """JSON Schema of the request's ``estimator`` field, generated from the registry."""
    outcome_objects = [
        {
            "type": "object",
            "title": f"outcome {name}",
            "properties": {
                "name": {"const": name},
                **{p.name: param_json_schema(p) for p in outcome.params},
            },
            "required": ["name"],
            "additionalProperties": False,
        }
        for name, outcome in OUTCOMES.items()
    ]
    outcome_schema = {"anyOf": [{"type": "string", "enum": list(OUTCOMES)}, *outcome_objects]}
    properties: dict[str, Any] = {"outcome": outcome_schema}
    for name, term in TERMS.items():
        properties[name] = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {p.name: param_json_schema(p) for p in term.params},
                    "additionalProperties": False,
                },
                {"type": "boolean"},
                {"type": "null"},
            ],
            "description": f"{term.doc} ({term.paper}); true or {{}}: on with defaults",
        }
    properties.update({p.name: param_json_schema(p) for p in TOP_LEVEL_PARAMS})
    return {
        "anyOf": [
            {"type": "string", "enum": sorted(presets()), "description": "a preset"},
            {"type": "object", "properties": properties, "additionalProperties": False},
            {"type": "null"},
        ],
        "description": f"a preset name or an estimator object (default: {DEFAULT_PRESET!r})",
        "default": DEFAULT_PRESET,
    }


def request_json_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the request schema, the component schemas it refers to)."""
    schema = AdvantageRequest.model_json_schema(ref_template=REF, by_alias=True)
    defs = schema.pop("$defs", {})
    schema["properties"]["estimator"] = estimator_json_schema()
    schema["properties"]["return"] = {
        "anyOf": [
            {"type": "array", "items": {"type": "string", "enum": list(all_diagnostics())}},
            {"type": "null"},
        ],
        "description": "diagnostics to return beside advantages",
    }
    return schema, defs


def error_content(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


ADVANTAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": AdvantageResponse,
        "description": "per-token advantages; Arrow when Accept prefers " + ARROW,
        "content": {ARROW: {"schema": {"type": "string", "format": "binary"}}},
    },
    401: error_content("no bearer token, or one the service does not know"),
    403: error_content("the token does not allow the request's namespace"),
    408: error_content("the body did not arrive within ADV_BODY_TIMEOUT_SECONDS"),
    409: error_content(
        "conflict: the request_id was already counted in the namespace for a different "
        "request (a retry must resend the same request)"
    ),
    413: error_content("over ADV_MAX_BODY_BYTES, ADV_MAX_REQUEST_TOKENS or ADV_MAX_GROUP_SIZE"),
    415: error_content("Content-Type is neither application/json nor " + ARROW),
    422: error_content("a request the service will not compute; names group, rollout, field"),
    503: {
        **error_content(
            "overloaded: the queue is full (ADV_MAX_QUEUE, ADV_MAX_QUEUE_BYTES) or the request "
            "waited past ADV_QUEUE_TIMEOUT_SECONDS; retry after retry_after_ms (the body) or "
            "Retry-After"
        ),
        "headers": {
            "Retry-After": {
                "description": "whole seconds to wait (retry_after_ms rounded up)",
                "schema": {"type": "integer"},
            }
        },
    },
    504: error_content("the computation took longer than ADV_REQUEST_TIMEOUT_SECONDS"),
}
# Routes behind the bearer token (the others: health, readiness, metrics, documentation).
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: ADVANTAGE_RESPONSES[401],
    403: ADVANTAGE_RESPONSES[403],
}


def document_request_body(app: FastAPI) -> None:
    """Put the request schemas (JSON and Arrow) and real examples into /openapi.json."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        request_schema, defs = request_json_schema()
        components.update(defs)
        components["AdvantageRequest"] = request_schema
        operation = schema["paths"]["/v1/advantages"]["post"]
        operation["requestBody"] = {
            "required": True,
            "content": {
                JSON: {
                    "schema": {"$ref": REF.format(model="AdvantageRequest")},
                    "example": EXAMPLE_REQUEST,
                },
                ARROW: {
                    "schema": {"type": "string", "format": "binary"},
                    "description": (
                        "one row per rollout: group_id utf8, reward float, tokens "
                        "list<int32>, optional prompt_key utf8, logprobs, entropy, "
                        "sum_pi_squared, is_weights, returns, planning_mask "
                        "and teacher.<name> list<float32>; "
                        "the other request fields as JSON in schema metadata advantage.request"
                    ),
                },
            },
        }
        example = jsonio.loads(jsonio.dumps(compute_in_process(EXAMPLE_REQUEST, device="cpu")))
        operation["responses"]["200"]["content"][JSON]["example"] = example
        # The statistics an answer fed: a client (or a stateful test) can follow the link.
        operation["responses"]["200"]["links"] = {
            "TokenStatistics": {
                "operationRef": "#/paths/~1v1~1stats~1tokens/get",
                "parameters": {"namespace": "$response.body#/namespace"},
                "description": "the vocabulary statistics of the request's namespace",
            }
        }
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
