from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ComputeOptions(_message.Message):
    __slots__ = ("namespace", "preset", "estimator_json", "ignore_token_ids", "vocab_size", "returns")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_JSON_FIELD_NUMBER: _ClassVar[int]
    IGNORE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    preset: str
    estimator_json: str
    ignore_token_ids: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    returns: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[str] = ..., preset: _Optional[str] = ..., estimator_json: _Optional[str] = ..., ignore_token_ids: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., returns: _Optional[_Iterable[str]] = ...) -> None: ...

class ComputeRequest(_message.Message):
    __slots__ = ("request_id", "options", "group_ids", "group_index", "offsets", "tokens", "rewards", "logprobs", "teacher_logprobs", "entropy", "sum_pi_squared", "is_weights", "returns", "prompt_keys", "planning_mask", "reward_components")
    class TeacherLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    SUM_PI_SQUARED_FIELD_NUMBER: _ClassVar[int]
    IS_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEYS_FIELD_NUMBER: _ClassVar[int]
    PLANNING_MASK_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    options: ComputeOptions
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    group_index: Tensor
    offsets: Tensor
    tokens: Tensor
    rewards: Tensor
    logprobs: Tensor
    teacher_logprobs: _containers.MessageMap[str, Tensor]
    entropy: Tensor
    sum_pi_squared: Tensor
    is_weights: Tensor
    returns: Tensor
    prompt_keys: _containers.RepeatedScalarFieldContainer[str]
    planning_mask: Tensor
    reward_components: _containers.MessageMap[str, Tensor]
    def __init__(self, request_id: _Optional[str] = ..., options: _Optional[_Union[ComputeOptions, _Mapping]] = ..., group_ids: _Optional[_Iterable[str]] = ..., group_index: _Optional[_Union[Tensor, _Mapping]] = ..., offsets: _Optional[_Union[Tensor, _Mapping]] = ..., tokens: _Optional[_Union[Tensor, _Mapping]] = ..., rewards: _Optional[_Union[Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., teacher_logprobs: _Optional[_Mapping[str, Tensor]] = ..., entropy: _Optional[_Union[Tensor, _Mapping]] = ..., sum_pi_squared: _Optional[_Union[Tensor, _Mapping]] = ..., is_weights: _Optional[_Union[Tensor, _Mapping]] = ..., returns: _Optional[_Union[Tensor, _Mapping]] = ..., prompt_keys: _Optional[_Iterable[str]] = ..., planning_mask: _Optional[_Union[Tensor, _Mapping]] = ..., reward_components: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class ComponentStats(_message.Message):
    __slots__ = ("mean", "std")
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    mean: float
    std: float
    def __init__(self, mean: _Optional[float] = ..., std: _Optional[float] = ...) -> None: ...

class ComponentValue(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: float
    def __init__(self, value: _Optional[float] = ...) -> None: ...

class Summary(_message.Message):
    __slots__ = ("tokens", "rollouts", "groups", "zero_signal_groups", "device", "compute_ms", "history", "batch_requests", "recorded", "group_history", "reward_components")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ComponentStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ComponentStats, _Mapping]] = ...) -> None: ...
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    ZERO_SIGNAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    BATCH_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    GROUP_HISTORY_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    rollouts: int
    groups: int
    zero_signal_groups: int
    device: str
    compute_ms: float
    history: str
    batch_requests: int
    recorded: bool
    group_history: _containers.RepeatedScalarFieldContainer[str]
    reward_components: _containers.MessageMap[str, ComponentStats]
    def __init__(self, tokens: _Optional[int] = ..., rollouts: _Optional[int] = ..., groups: _Optional[int] = ..., zero_signal_groups: _Optional[int] = ..., device: _Optional[str] = ..., compute_ms: _Optional[float] = ..., history: _Optional[str] = ..., batch_requests: _Optional[int] = ..., recorded: _Optional[bool] = ..., group_history: _Optional[_Iterable[str]] = ..., reward_components: _Optional[_Mapping[str, ComponentStats]] = ...) -> None: ...

class ComputeResponse(_message.Message):
    __slots__ = ("request_id", "namespace", "estimator_json", "group_ids", "group_index", "offsets", "advantages", "scalars", "diagnostics", "summary")
    class DiagnosticsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_JSON_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTICS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    namespace: str
    estimator_json: str
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    group_index: Tensor
    offsets: Tensor
    advantages: Tensor
    scalars: Tensor
    diagnostics: _containers.MessageMap[str, Tensor]
    summary: Summary
    def __init__(self, request_id: _Optional[str] = ..., namespace: _Optional[str] = ..., estimator_json: _Optional[str] = ..., group_ids: _Optional[_Iterable[str]] = ..., group_index: _Optional[_Union[Tensor, _Mapping]] = ..., offsets: _Optional[_Union[Tensor, _Mapping]] = ..., advantages: _Optional[_Union[Tensor, _Mapping]] = ..., scalars: _Optional[_Union[Tensor, _Mapping]] = ..., diagnostics: _Optional[_Mapping[str, Tensor]] = ..., summary: _Optional[_Union[Summary, _Mapping]] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("group_id", "group_size", "rollout_id", "tokens", "reward", "logprobs", "teacher_logprobs", "entropy", "sum_pi_squared", "is_weights", "returns", "prompt_key", "planning_mask", "reward_components")
    class TeacherLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ComponentValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ComponentValue, _Mapping]] = ...) -> None: ...
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    SUM_PI_SQUARED_FIELD_NUMBER: _ClassVar[int]
    IS_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    PLANNING_MASK_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    group_size: int
    rollout_id: str
    tokens: Tensor
    reward: float
    logprobs: Tensor
    teacher_logprobs: _containers.MessageMap[str, Tensor]
    entropy: Tensor
    sum_pi_squared: Tensor
    is_weights: Tensor
    returns: Tensor
    prompt_key: str
    planning_mask: Tensor
    reward_components: _containers.MessageMap[str, ComponentValue]
    def __init__(self, group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., rollout_id: _Optional[str] = ..., tokens: _Optional[_Union[Tensor, _Mapping]] = ..., reward: _Optional[float] = ..., logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., teacher_logprobs: _Optional[_Mapping[str, Tensor]] = ..., entropy: _Optional[_Union[Tensor, _Mapping]] = ..., sum_pi_squared: _Optional[_Union[Tensor, _Mapping]] = ..., is_weights: _Optional[_Union[Tensor, _Mapping]] = ..., returns: _Optional[_Union[Tensor, _Mapping]] = ..., prompt_key: _Optional[str] = ..., planning_mask: _Optional[_Union[Tensor, _Mapping]] = ..., reward_components: _Optional[_Mapping[str, ComponentValue]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("options", "rollout")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    options: ComputeOptions
    rollout: Rollout
    def __init__(self, options: _Optional[_Union[ComputeOptions, _Mapping]] = ..., rollout: _Optional[_Union[Rollout, _Mapping]] = ...) -> None: ...

class RolloutResult(_message.Message):
    __slots__ = ("rollout_id", "rollout_index", "advantages", "scalar", "diagnostics")
    class DiagnosticsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTICS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    rollout_index: int
    advantages: Tensor
    scalar: float
    diagnostics: _containers.MessageMap[str, Tensor]
    def __init__(self, rollout_id: _Optional[str] = ..., rollout_index: _Optional[int] = ..., advantages: _Optional[_Union[Tensor, _Mapping]] = ..., scalar: _Optional[float] = ..., diagnostics: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class GroupResult(_message.Message):
    __slots__ = ("group_id", "rollouts", "request_id", "estimator_json", "summary")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_JSON_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    rollouts: _containers.RepeatedCompositeFieldContainer[RolloutResult]
    request_id: str
    estimator_json: str
    summary: Summary
    def __init__(self, group_id: _Optional[str] = ..., rollouts: _Optional[_Iterable[_Union[RolloutResult, _Mapping]]] = ..., request_id: _Optional[str] = ..., estimator_json: _Optional[str] = ..., summary: _Optional[_Union[Summary, _Mapping]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "group_id", "rollout_index", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    group_id: str
    rollout_index: int
    field: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., group_id: _Optional[str] = ..., rollout_index: _Optional[int] = ..., field: _Optional[str] = ...) -> None: ...

class GroupError(_message.Message):
    __slots__ = ("group_id", "error", "rollout_ids")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    error: Error
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_id: _Optional[str] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., rollout_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("result", "error")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    result: GroupResult
    error: GroupError
    def __init__(self, result: _Optional[_Union[GroupResult, _Mapping]] = ..., error: _Optional[_Union[GroupError, _Mapping]] = ...) -> None: ...

class ListEstimatorsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEstimatorsResponse(_message.Message):
    __slots__ = ("default_preset", "presets", "outcomes", "terms", "diagnostics", "listing_json")
    DEFAULT_PRESET_FIELD_NUMBER: _ClassVar[int]
    PRESETS_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTICS_FIELD_NUMBER: _ClassVar[int]
    LISTING_JSON_FIELD_NUMBER: _ClassVar[int]
    default_preset: str
    presets: _containers.RepeatedScalarFieldContainer[str]
    outcomes: _containers.RepeatedScalarFieldContainer[str]
    terms: _containers.RepeatedScalarFieldContainer[str]
    diagnostics: _containers.RepeatedScalarFieldContainer[str]
    listing_json: str
    def __init__(self, default_preset: _Optional[str] = ..., presets: _Optional[_Iterable[str]] = ..., outcomes: _Optional[_Iterable[str]] = ..., terms: _Optional[_Iterable[str]] = ..., diagnostics: _Optional[_Iterable[str]] = ..., listing_json: _Optional[str] = ...) -> None: ...
