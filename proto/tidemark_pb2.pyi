from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Ack(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_UNSPECIFIED: _ClassVar[Ack]
    ACK_LEADER: _ClassVar[Ack]
    ACK_FLUSH: _ClassVar[Ack]
    ACK_REPLICA: _ClassVar[Ack]

class Isolation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ISOLATION_UNSPECIFIED: _ClassVar[Isolation]
    ISOLATION_READ_COMMITTED: _ClassVar[Isolation]
    ISOLATION_READ_UNCOMMITTED: _ClassVar[Isolation]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_MASTER: _ClassVar[Role]
    ROLE_SLAVE: _ClassVar[Role]

class ResetTo(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESET_TO_UNSPECIFIED: _ClassVar[ResetTo]
    RESET_TO_LATEST: _ClassVar[ResetTo]
    RESET_TO_TIME: _ClassVar[ResetTo]
    RESET_TO_OFFSET: _ClassVar[ResetTo]
    RESET_TO_EARLIEST: _ClassVar[ResetTo]

class TransactionOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSACTION_OUTCOME_UNSPECIFIED: _ClassVar[TransactionOutcome]
    TRANSACTION_OUTCOME_COMMITTED: _ClassVar[TransactionOutcome]
    TRANSACTION_OUTCOME_ABORTED: _ClassVar[TransactionOutcome]
ACK_UNSPECIFIED: Ack
ACK_LEADER: Ack
ACK_FLUSH: Ack
ACK_REPLICA: Ack
ISOLATION_UNSPECIFIED: Isolation
ISOLATION_READ_COMMITTED: Isolation
ISOLATION_READ_UNCOMMITTED: Isolation
ROLE_UNSPECIFIED: Role
ROLE_MASTER: Role
ROLE_SLAVE: Role
RESET_TO_UNSPECIFIED: ResetTo
RESET_TO_LATEST: ResetTo
RESET_TO_TIME: ResetTo
RESET_TO_OFFSET: ResetTo
RESET_TO_EARLIEST: ResetTo
TRANSACTION_OUTCOME_UNSPECIFIED: TransactionOutcome
TRANSACTION_OUTCOME_COMMITTED: TransactionOutcome
TRANSACTION_OUTCOME_ABORTED: TransactionOutcome

class ProduceBatch(_message.Message):
    __slots__ = ("topic", "queue_id", "producer_id", "base_sequence", "record_count", "records_crc", "records", "delayed")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RECORD_COUNT_FIELD_NUMBER: _ClassVar[int]
    RECORDS_CRC_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    DELAYED_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_id: int
    producer_id: int
    base_sequence: int
    record_count: int
    records_crc: int
    records: bytes
    delayed: bool
    def __init__(self, topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., producer_id: _Optional[int] = ..., base_sequence: _Optional[int] = ..., record_count: _Optional[int] = ..., records_crc: _Optional[int] = ..., records: _Optional[bytes] = ..., delayed: _Optional[bool] = ...) -> None: ...

class PlainMessage(_message.Message):
    __slots__ = ("topic", "queue_id", "key", "body", "properties", "deliver_at_ms", "sequence")
    class PropertiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    DELIVER_AT_MS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_id: int
    key: str
    body: bytes
    properties: _containers.ScalarMap[str, str]
    deliver_at_ms: int
    sequence: int
    def __init__(self, topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., key: _Optional[str] = ..., body: _Optional[bytes] = ..., properties: _Optional[_Mapping[str, str]] = ..., deliver_at_ms: _Optional[int] = ..., sequence: _Optional[int] = ...) -> None: ...

class SendRequest(_message.Message):
    __slots__ = ("batches", "ack", "timeout_ms", "messages", "producer_id", "transaction", "begin", "commit")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSACTION_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[ProduceBatch]
    ack: Ack
    timeout_ms: int
    messages: _containers.RepeatedCompositeFieldContainer[PlainMessage]
    producer_id: int
    transaction: int
    begin: BeginTransactionRequest
    commit: EndTransactionRequest
    def __init__(self, batches: _Optional[_Iterable[_Union[ProduceBatch, _Mapping]]] = ..., ack: _Optional[_Union[Ack, str]] = ..., timeout_ms: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[PlainMessage, _Mapping]]] = ..., producer_id: _Optional[int] = ..., transaction: _Optional[int] = ..., begin: _Optional[_Union[BeginTransactionRequest, _Mapping]] = ..., commit: _Optional[_Union[EndTransactionRequest, _Mapping]] = ...) -> None: ...

class BatchReceipt(_message.Message):
    __slots__ = ("commit_offset", "base_queue_offset", "record_count", "duplicate")
    COMMIT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BASE_QUEUE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RECORD_COUNT_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    commit_offset: int
    base_queue_offset: int
    record_count: int
    duplicate: bool
    def __init__(self, commit_offset: _Optional[int] = ..., base_queue_offset: _Optional[int] = ..., record_count: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class MessageReceipt(_message.Message):
    __slots__ = ("topic", "queue_id", "queue_offset", "commit_offset", "duplicate", "timer_offset", "deliver_at_ms")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    COMMIT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    TIMER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DELIVER_AT_MS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_id: int
    queue_offset: int
    commit_offset: int
    duplicate: bool
    timer_offset: int
    deliver_at_ms: int
    def __init__(self, topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., queue_offset: _Optional[int] = ..., commit_offset: _Optional[int] = ..., duplicate: _Optional[bool] = ..., timer_offset: _Optional[int] = ..., deliver_at_ms: _Optional[int] = ...) -> None: ...

class SendResponse(_message.Message):
    __slots__ = ("receipts", "message_receipts", "begun", "ended")
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    BEGUN_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    receipts: _containers.RepeatedCompositeFieldContainer[BatchReceipt]
    message_receipts: _containers.RepeatedCompositeFieldContainer[MessageReceipt]
    begun: BeginTransactionResponse
    ended: EndTransactionResponse
    def __init__(self, receipts: _Optional[_Iterable[_Union[BatchReceipt, _Mapping]]] = ..., message_receipts: _Optional[_Iterable[_Union[MessageReceipt, _Mapping]]] = ..., begun: _Optional[_Union[BeginTransactionResponse, _Mapping]] = ..., ended: _Optional[_Union[EndTransactionResponse, _Mapping]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("topic", "queue_id", "offset", "max_messages", "max_wait_ms", "max_bytes", "decode", "isolation")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_id: int
    offset: int
    max_messages: int
    max_wait_ms: int
    max_bytes: int
    decode: bool
    isolation: Isolation
    def __init__(self, topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., offset: _Optional[int] = ..., max_messages: _Optional[int] = ..., max_wait_ms: _Optional[int] = ..., max_bytes: _Optional[int] = ..., decode: _Optional[bool] = ..., isolation: _Optional[_Union[Isolation, str]] = ...) -> None: ...

class PulledMessage(_message.Message):
    __slots__ = ("queue_offset", "commit_offset", "store_time_ms", "key", "body", "properties", "deliver_at_ms", "timer_offset")
    class PropertiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    QUEUE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    COMMIT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STORE_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    DELIVER_AT_MS_FIELD_NUMBER: _ClassVar[int]
    TIMER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    queue_offset: int
    commit_offset: int
    store_time_ms: int
    key: str
    body: bytes
    properties: _containers.ScalarMap[str, str]
    deliver_at_ms: int
    timer_offset: int
    def __init__(self, queue_offset: _Optional[int] = ..., commit_offset: _Optional[int] = ..., store_time_ms: _Optional[int] = ..., key: _Optional[str] = ..., body: _Optional[bytes] = ..., properties: _Optional[_Mapping[str, str]] = ..., deliver_at_ms: _Optional[int] = ..., timer_offset: _Optional[int] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("batches", "skip_first", "count", "next_offset", "min_offset", "max_offset", "messages")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedScalarFieldContainer[bytes]
    skip_first: int
    count: int
    next_offset: int
    min_offset: int
    max_offset: int
    messages: _containers.RepeatedCompositeFieldContainer[PulledMessage]
    def __init__(self, batches: _Optional[_Iterable[bytes]] = ..., skip_first: _Optional[int] = ..., count: _Optional[int] = ..., next_offset: _Optional[int] = ..., min_offset: _Optional[int] = ..., max_offset: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[PulledMessage, _Mapping]]] = ...) -> None: ...

class LogSpan(_message.Message):
    __slots__ = ("path", "position", "length")
    PATH_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    path: str
    position: int
    length: int
    def __init__(self, path: _Optional[str] = ..., position: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PullLocalRequest(_message.Message):
    __slots__ = ("topic", "queue_id", "offset", "max_messages", "max_wait_ms", "max_bytes", "isolation")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_id: int
    offset: int
    max_messages: int
    max_wait_ms: int
    max_bytes: int
    isolation: Isolation
    def __init__(self, topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., offset: _Optional[int] = ..., max_messages: _Optional[int] = ..., max_wait_ms: _Optional[int] = ..., max_bytes: _Optional[int] = ..., isolation: _Optional[_Union[Isolation, str]] = ...) -> None: ...

class PullLocalResponse(_message.Message):
    __slots__ = ("spans", "skip_first", "count", "next_offset", "min_offset", "max_offset", "instance_file", "instance")
    SPANS_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FILE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    spans: _containers.RepeatedCompositeFieldContainer[LogSpan]
    skip_first: int
    count: int
    next_offset: int
    min_offset: int
    max_offset: int
    instance_file: str
    instance: str
    def __init__(self, spans: _Optional[_Iterable[_Union[LogSpan, _Mapping]]] = ..., skip_first: _Optional[int] = ..., count: _Optional[int] = ..., next_offset: _Optional[int] = ..., min_offset: _Optional[int] = ..., max_offset: _Optional[int] = ..., instance_file: _Optional[str] = ..., instance: _Optional[str] = ...) -> None: ...

class OffsetForTimeRequest(_message.Message):
    __slots__ = ("topic", "queue_id", "timestamp_ms")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_id: int
    timestamp_ms: int
    def __init__(self, topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class OffsetForTimeResponse(_message.Message):
    __slots__ = ("offset",)
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    offset: int
    def __init__(self, offset: _Optional[int] = ...) -> None: ...

class CommittedOffset(_message.Message):
    __slots__ = ("group", "topic", "queue_id", "offset")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    group: str
    topic: str
    queue_id: int
    offset: int
    def __init__(self, group: _Optional[str] = ..., topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class CommitOffsetRequest(_message.Message):
    __slots__ = ("offsets",)
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    offsets: _containers.RepeatedCompositeFieldContainer[CommittedOffset]
    def __init__(self, offsets: _Optional[_Iterable[_Union[CommittedOffset, _Mapping]]] = ...) -> None: ...

class CommitOffsetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetOffsetRequest(_message.Message):
    __slots__ = ("group", "topic", "queue_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    topic: str
    queue_id: int
    def __init__(self, group: _Optional[str] = ..., topic: _Optional[str] = ..., queue_id: _Optional[int] = ...) -> None: ...

class GetOffsetResponse(_message.Message):
    __slots__ = ("found", "offset")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    found: bool
    offset: int
    def __init__(self, found: _Optional[bool] = ..., offset: _Optional[int] = ...) -> None: ...

class TopicInfo(_message.Message):
    __slots__ = ("name", "queues", "queue_max_offsets", "queue_stable_offsets")
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MAX_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_STABLE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    name: str
    queues: int
    queue_max_offsets: _containers.RepeatedScalarFieldContainer[int]
    queue_stable_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., queues: _Optional[int] = ..., queue_max_offsets: _Optional[_Iterable[int]] = ..., queue_stable_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class CreateTopicRequest(_message.Message):
    __slots__ = ("name", "queues")
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    queues: int
    def __init__(self, name: _Optional[str] = ..., queues: _Optional[int] = ...) -> None: ...

class CreateTopicResponse(_message.Message):
    __slots__ = ("topic",)
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    topic: TopicInfo
    def __init__(self, topic: _Optional[_Union[TopicInfo, _Mapping]] = ...) -> None: ...

class CreateTopicsRequest(_message.Message):
    __slots__ = ("topics",)
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedCompositeFieldContainer[CreateTopicRequest]
    def __init__(self, topics: _Optional[_Iterable[_Union[CreateTopicRequest, _Mapping]]] = ...) -> None: ...

class CreateTopicsResponse(_message.Message):
    __slots__ = ("topics",)
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedCompositeFieldContainer[TopicInfo]
    def __init__(self, topics: _Optional[_Iterable[_Union[TopicInfo, _Mapping]]] = ...) -> None: ...

class ListTopicsRequest(_message.Message):
    __slots__ = ("include_system",)
    INCLUDE_SYSTEM_FIELD_NUMBER: _ClassVar[int]
    include_system: bool
    def __init__(self, include_system: _Optional[bool] = ...) -> None: ...

class ListTopicsResponse(_message.Message):
    __slots__ = ("topics",)
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedCompositeFieldContainer[TopicInfo]
    def __init__(self, topics: _Optional[_Iterable[_Union[TopicInfo, _Mapping]]] = ...) -> None: ...

class DeleteTopicRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteTopicResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PromoteRequest(_message.Message):
    __slots__ = ("unclean",)
    UNCLEAN_FIELD_NUMBER: _ClassVar[int]
    unclean: bool
    def __init__(self, unclean: _Optional[bool] = ...) -> None: ...

class PromoteResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class DemoteRequest(_message.Message):
    __slots__ = ("master",)
    MASTER_FIELD_NUMBER: _ClassVar[int]
    master: str
    def __init__(self, master: _Optional[str] = ...) -> None: ...

class DemoteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CancelTimerRequest(_message.Message):
    __slots__ = ("timer_offset", "topic", "queue_id")
    TIMER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    timer_offset: int
    topic: str
    queue_id: int
    def __init__(self, timer_offset: _Optional[int] = ..., topic: _Optional[str] = ..., queue_id: _Optional[int] = ...) -> None: ...

class CancelTimerResponse(_message.Message):
    __slots__ = ("deliver_at_ms", "topic", "queue_id")
    DELIVER_AT_MS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    deliver_at_ms: int
    topic: str
    queue_id: int
    def __init__(self, deliver_at_ms: _Optional[int] = ..., topic: _Optional[str] = ..., queue_id: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("node_id", "address", "acked_offset", "in_sync", "connected", "lag_bytes", "coordinator_unreachable_ms", "heard_ms_ago")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ACKED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LAG_BYTES_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_UNREACHABLE_MS_FIELD_NUMBER: _ClassVar[int]
    HEARD_MS_AGO_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    acked_offset: int
    in_sync: bool
    connected: bool
    lag_bytes: int
    coordinator_unreachable_ms: int
    heard_ms_ago: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., acked_offset: _Optional[int] = ..., in_sync: _Optional[bool] = ..., connected: _Optional[bool] = ..., lag_bytes: _Optional[int] = ..., coordinator_unreachable_ms: _Optional[int] = ..., heard_ms_ago: _Optional[int] = ...) -> None: ...

class FollowerStatus(_message.Message):
    __slots__ = ("master", "connected", "master_confirm_offset", "master_end_offset", "lag_bytes", "in_sync", "error")
    MASTER_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    MASTER_CONFIRM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MASTER_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAG_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    master: str
    connected: bool
    master_confirm_offset: int
    master_end_offset: int
    lag_bytes: int
    in_sync: bool
    error: str
    def __init__(self, master: _Optional[str] = ..., connected: _Optional[bool] = ..., master_confirm_offset: _Optional[int] = ..., master_end_offset: _Optional[int] = ..., lag_bytes: _Optional[int] = ..., in_sync: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class CoordinatorStatus(_message.Message):
    __slots__ = ("connected", "node_id", "leader", "leader_client", "epoch", "lease_remaining_ms", "insync", "failsafe", "error")
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_CLIENT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    INSYNC_FIELD_NUMBER: _ClassVar[int]
    FAILSAFE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    connected: bool
    node_id: str
    leader: str
    leader_client: str
    epoch: int
    lease_remaining_ms: int
    insync: _containers.RepeatedScalarFieldContainer[str]
    failsafe: bool
    error: str
    def __init__(self, connected: _Optional[bool] = ..., node_id: _Optional[str] = ..., leader: _Optional[str] = ..., leader_client: _Optional[str] = ..., epoch: _Optional[int] = ..., lease_remaining_ms: _Optional[int] = ..., insync: _Optional[_Iterable[str]] = ..., failsafe: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class TieredStatus(_message.Message):
    __slots__ = ("backend", "uploaded_offset", "recorded_offset", "uploading", "objects", "readable_min_offset", "read_cache_bytes", "error")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RECORDED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    UPLOADING_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    READABLE_MIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    READ_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    backend: str
    uploaded_offset: int
    recorded_offset: int
    uploading: bool
    objects: int
    readable_min_offset: int
    read_cache_bytes: int
    error: str
    def __init__(self, backend: _Optional[str] = ..., uploaded_offset: _Optional[int] = ..., recorded_offset: _Optional[int] = ..., uploading: _Optional[bool] = ..., objects: _Optional[int] = ..., readable_min_offset: _Optional[int] = ..., read_cache_bytes: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ComponentError(_message.Message):
    __slots__ = ("component", "count", "error", "last_ms", "active")
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_MS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    component: str
    count: int
    error: str
    last_ms: int
    active: bool
    def __init__(self, component: _Optional[str] = ..., count: _Optional[int] = ..., error: _Optional[str] = ..., last_ms: _Optional[int] = ..., active: _Optional[bool] = ...) -> None: ...

class RecoveryStatus(_message.Message):
    __slots__ = ("clean", "new", "scanned_bytes", "truncated_bytes", "replayed_bytes", "replay_seconds", "seconds")
    CLEAN_FIELD_NUMBER: _ClassVar[int]
    NEW_FIELD_NUMBER: _ClassVar[int]
    SCANNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    clean: bool
    new: bool
    scanned_bytes: int
    truncated_bytes: int
    replayed_bytes: int
    replay_seconds: float
    seconds: float
    def __init__(self, clean: _Optional[bool] = ..., new: _Optional[bool] = ..., scanned_bytes: _Optional[int] = ..., truncated_bytes: _Optional[int] = ..., replayed_bytes: _Optional[int] = ..., replay_seconds: _Optional[float] = ..., seconds: _Optional[float] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("role", "epoch", "node_id", "cluster_id", "master", "min_offset", "max_offset", "flushed_offset", "confirm_offset", "applied_offset", "replicas", "replication", "tiered_uploaded_offset", "tiered", "timer_pending", "timer_pending_by_topic", "segments", "log_bytes", "free_disk_bytes", "fenced", "views", "retention_floor", "recovery", "errors", "coordinator", "long_polls", "open_files", "open_files_max", "transactions")
    class TimerPendingByTopicEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ViewsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    MIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FLUSHED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    APPLIED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    TIERED_UPLOADED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIERED_FIELD_NUMBER: _ClassVar[int]
    TIMER_PENDING_FIELD_NUMBER: _ClassVar[int]
    TIMER_PENDING_BY_TOPIC_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    LOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    VIEWS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FLOOR_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    LONG_POLLS_FIELD_NUMBER: _ClassVar[int]
    OPEN_FILES_FIELD_NUMBER: _ClassVar[int]
    OPEN_FILES_MAX_FIELD_NUMBER: _ClassVar[int]
    TRANSACTIONS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    epoch: int
    node_id: str
    cluster_id: str
    master: str
    min_offset: int
    max_offset: int
    flushed_offset: int
    confirm_offset: int
    applied_offset: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    replication: FollowerStatus
    tiered_uploaded_offset: int
    tiered: TieredStatus
    timer_pending: int
    timer_pending_by_topic: _containers.ScalarMap[str, int]
    segments: int
    log_bytes: int
    free_disk_bytes: int
    fenced: str
    views: _containers.ScalarMap[str, int]
    retention_floor: int
    recovery: RecoveryStatus
    errors: _containers.RepeatedCompositeFieldContainer[ComponentError]
    coordinator: CoordinatorStatus
    long_polls: int
    open_files: int
    open_files_max: int
    transactions: TransactionsStatus
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., epoch: _Optional[int] = ..., node_id: _Optional[str] = ..., cluster_id: _Optional[str] = ..., master: _Optional[str] = ..., min_offset: _Optional[int] = ..., max_offset: _Optional[int] = ..., flushed_offset: _Optional[int] = ..., confirm_offset: _Optional[int] = ..., applied_offset: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., replication: _Optional[_Union[FollowerStatus, _Mapping]] = ..., tiered_uploaded_offset: _Optional[int] = ..., tiered: _Optional[_Union[TieredStatus, _Mapping]] = ..., timer_pending: _Optional[int] = ..., timer_pending_by_topic: _Optional[_Mapping[str, int]] = ..., segments: _Optional[int] = ..., log_bytes: _Optional[int] = ..., free_disk_bytes: _Optional[int] = ..., fenced: _Optional[str] = ..., views: _Optional[_Mapping[str, int]] = ..., retention_floor: _Optional[int] = ..., recovery: _Optional[_Union[RecoveryStatus, _Mapping]] = ..., errors: _Optional[_Iterable[_Union[ComponentError, _Mapping]]] = ..., coordinator: _Optional[_Union[CoordinatorStatus, _Mapping]] = ..., long_polls: _Optional[int] = ..., open_files: _Optional[int] = ..., open_files_max: _Optional[int] = ..., transactions: _Optional[_Union[TransactionsStatus, _Mapping]] = ...) -> None: ...

class TransactionsStatus(_message.Message):
    __slots__ = ("open", "oldest_open_ms", "committed", "aborted", "timed_out", "aborted_ranges", "prepared", "undelivered")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    OLDEST_OPEN_MS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    ABORTED_RANGES_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    UNDELIVERED_FIELD_NUMBER: _ClassVar[int]
    open: int
    oldest_open_ms: int
    committed: int
    aborted: int
    timed_out: int
    aborted_ranges: int
    prepared: int
    undelivered: int
    def __init__(self, open: _Optional[int] = ..., oldest_open_ms: _Optional[int] = ..., committed: _Optional[int] = ..., aborted: _Optional[int] = ..., timed_out: _Optional[int] = ..., aborted_ranges: _Optional[int] = ..., prepared: _Optional[int] = ..., undelivered: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("json", "status")
    JSON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    json: str
    status: NodeStatus
    def __init__(self, json: _Optional[str] = ..., status: _Optional[_Union[NodeStatus, _Mapping]] = ...) -> None: ...

class QueueRef(_message.Message):
    __slots__ = ("topic", "queue_id")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_id: int
    def __init__(self, topic: _Optional[str] = ..., queue_id: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("group", "member_id", "topics", "owned", "session_timeout_ms", "leave", "max_wait_ms", "client_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    SESSION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    member_id: str
    topics: _containers.RepeatedScalarFieldContainer[str]
    owned: _containers.RepeatedCompositeFieldContainer[QueueRef]
    session_timeout_ms: int
    leave: bool
    max_wait_ms: int
    client_id: str
    def __init__(self, group: _Optional[str] = ..., member_id: _Optional[str] = ..., topics: _Optional[_Iterable[str]] = ..., owned: _Optional[_Iterable[_Union[QueueRef, _Mapping]]] = ..., session_timeout_ms: _Optional[int] = ..., leave: _Optional[bool] = ..., max_wait_ms: _Optional[int] = ..., client_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("member_id", "assigned", "heartbeat_interval_ms", "generation")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    assigned: _containers.RepeatedCompositeFieldContainer[QueueRef]
    heartbeat_interval_ms: int
    generation: int
    def __init__(self, member_id: _Optional[str] = ..., assigned: _Optional[_Iterable[_Union[QueueRef, _Mapping]]] = ..., heartbeat_interval_ms: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class PopRequest(_message.Message):
    __slots__ = ("group", "topic", "max_messages", "invisible_ms", "max_wait_ms", "start_earliest", "as_runs", "decode", "isolation", "ack_receipt_handles")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    INVISIBLE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    START_EARLIEST_FIELD_NUMBER: _ClassVar[int]
    AS_RUNS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    ACK_RECEIPT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    group: str
    topic: str
    max_messages: int
    invisible_ms: int
    max_wait_ms: int
    start_earliest: bool
    as_runs: bool
    decode: bool
    isolation: Isolation
    ack_receipt_handles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group: _Optional[str] = ..., topic: _Optional[str] = ..., max_messages: _Optional[int] = ..., invisible_ms: _Optional[int] = ..., max_wait_ms: _Optional[int] = ..., start_earliest: _Optional[bool] = ..., as_runs: _Optional[bool] = ..., decode: _Optional[bool] = ..., isolation: _Optional[_Union[Isolation, str]] = ..., ack_receipt_handles: _Optional[_Iterable[str]] = ...) -> None: ...

class PoppedMessage(_message.Message):
    __slots__ = ("queue_id", "queue_offset", "commit_offset", "store_time_ms", "record", "receipt_handle", "delivery_count", "key", "body", "properties", "deliver_at_ms", "timer_offset")
    class PropertiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    COMMIT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STORE_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_COUNT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    DELIVER_AT_MS_FIELD_NUMBER: _ClassVar[int]
    TIMER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    queue_id: int
    queue_offset: int
    commit_offset: int
    store_time_ms: int
    record: bytes
    receipt_handle: str
    delivery_count: int
    key: str
    body: bytes
    properties: _containers.ScalarMap[str, str]
    deliver_at_ms: int
    timer_offset: int
    def __init__(self, queue_id: _Optional[int] = ..., queue_offset: _Optional[int] = ..., commit_offset: _Optional[int] = ..., store_time_ms: _Optional[int] = ..., record: _Optional[bytes] = ..., receipt_handle: _Optional[str] = ..., delivery_count: _Optional[int] = ..., key: _Optional[str] = ..., body: _Optional[bytes] = ..., properties: _Optional[_Mapping[str, str]] = ..., deliver_at_ms: _Optional[int] = ..., timer_offset: _Optional[int] = ...) -> None: ...

class PoppedRun(_message.Message):
    __slots__ = ("queue_id", "first_offset", "count", "delivery_count", "receipt_handle", "batches", "skip_first")
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_COUNT_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIRST_FIELD_NUMBER: _ClassVar[int]
    queue_id: int
    first_offset: int
    count: int
    delivery_count: int
    receipt_handle: str
    batches: _containers.RepeatedScalarFieldContainer[bytes]
    skip_first: int
    def __init__(self, queue_id: _Optional[int] = ..., first_offset: _Optional[int] = ..., count: _Optional[int] = ..., delivery_count: _Optional[int] = ..., receipt_handle: _Optional[str] = ..., batches: _Optional[_Iterable[bytes]] = ..., skip_first: _Optional[int] = ...) -> None: ...

class PopResponse(_message.Message):
    __slots__ = ("messages", "runs", "ack_results")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    ACK_RESULTS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[PoppedMessage]
    runs: _containers.RepeatedCompositeFieldContainer[PoppedRun]
    ack_results: _containers.RepeatedCompositeFieldContainer[HandleResult]
    def __init__(self, messages: _Optional[_Iterable[_Union[PoppedMessage, _Mapping]]] = ..., runs: _Optional[_Iterable[_Union[PoppedRun, _Mapping]]] = ..., ack_results: _Optional[_Iterable[_Union[HandleResult, _Mapping]]] = ...) -> None: ...

class HandleResult(_message.Message):
    __slots__ = ("receipt_handle", "code", "message")
    RECEIPT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    receipt_handle: str
    code: int
    message: str
    def __init__(self, receipt_handle: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("group", "receipt_handles")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    group: str
    receipt_handles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group: _Optional[str] = ..., receipt_handles: _Optional[_Iterable[str]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[HandleResult]
    def __init__(self, results: _Optional[_Iterable[_Union[HandleResult, _Mapping]]] = ...) -> None: ...

class NackRequest(_message.Message):
    __slots__ = ("group", "receipt_handles", "delay_ms")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    group: str
    receipt_handles: _containers.RepeatedScalarFieldContainer[str]
    delay_ms: int
    def __init__(self, group: _Optional[str] = ..., receipt_handles: _Optional[_Iterable[str]] = ..., delay_ms: _Optional[int] = ...) -> None: ...

class NackResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[HandleResult]
    def __init__(self, results: _Optional[_Iterable[_Union[HandleResult, _Mapping]]] = ...) -> None: ...

class ChangeInvisibleRequest(_message.Message):
    __slots__ = ("group", "receipt_handle", "invisible_ms")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    INVISIBLE_MS_FIELD_NUMBER: _ClassVar[int]
    group: str
    receipt_handle: str
    invisible_ms: int
    def __init__(self, group: _Optional[str] = ..., receipt_handle: _Optional[str] = ..., invisible_ms: _Optional[int] = ...) -> None: ...

class ChangeInvisibleResponse(_message.Message):
    __slots__ = ("receipt_handle",)
    RECEIPT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    receipt_handle: str
    def __init__(self, receipt_handle: _Optional[str] = ...) -> None: ...

class ListGroupsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GroupSummary(_message.Message):
    __slots__ = ("name", "members", "topics", "lag", "remote_offsets")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    REMOTE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    name: str
    members: int
    topics: _containers.RepeatedScalarFieldContainer[str]
    lag: int
    remote_offsets: _containers.RepeatedCompositeFieldContainer[CommittedOffset]
    def __init__(self, name: _Optional[str] = ..., members: _Optional[int] = ..., topics: _Optional[_Iterable[str]] = ..., lag: _Optional[int] = ..., remote_offsets: _Optional[_Iterable[_Union[CommittedOffset, _Mapping]]] = ...) -> None: ...

class ListGroupsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupSummary]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupSummary, _Mapping]]] = ...) -> None: ...

class DescribeGroupRequest(_message.Message):
    __slots__ = ("group", "here_only", "queues")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    HERE_ONLY_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    group: str
    here_only: bool
    queues: _containers.RepeatedCompositeFieldContainer[QueueRef]
    def __init__(self, group: _Optional[str] = ..., here_only: _Optional[bool] = ..., queues: _Optional[_Iterable[_Union[QueueRef, _Mapping]]] = ...) -> None: ...

class GroupMember(_message.Message):
    __slots__ = ("member_id", "client_id", "topics", "assigned", "session_timeout_ms", "last_heartbeat_ms_ago")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    SESSION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_MS_AGO_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    client_id: str
    topics: _containers.RepeatedScalarFieldContainer[str]
    assigned: _containers.RepeatedCompositeFieldContainer[QueueRef]
    session_timeout_ms: int
    last_heartbeat_ms_ago: int
    def __init__(self, member_id: _Optional[str] = ..., client_id: _Optional[str] = ..., topics: _Optional[_Iterable[str]] = ..., assigned: _Optional[_Iterable[_Union[QueueRef, _Mapping]]] = ..., session_timeout_ms: _Optional[int] = ..., last_heartbeat_ms_ago: _Optional[int] = ...) -> None: ...

class GroupQueue(_message.Message):
    __slots__ = ("topic", "queue_id", "has_committed", "committed_offset", "end_offset", "lag", "owner", "in_flight", "pop_offset", "shard")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    POP_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_id: int
    has_committed: bool
    committed_offset: int
    end_offset: int
    lag: int
    owner: str
    in_flight: int
    pop_offset: int
    shard: str
    def __init__(self, topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., has_committed: _Optional[bool] = ..., committed_offset: _Optional[int] = ..., end_offset: _Optional[int] = ..., lag: _Optional[int] = ..., owner: _Optional[str] = ..., in_flight: _Optional[int] = ..., pop_offset: _Optional[int] = ..., shard: _Optional[str] = ...) -> None: ...

class GroupDescription(_message.Message):
    __slots__ = ("name", "generation", "rebalances", "members", "queues", "dlq_messages", "redeliveries", "shard")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REBALANCES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    DLQ_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REDELIVERIES_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    generation: int
    rebalances: int
    members: _containers.RepeatedCompositeFieldContainer[GroupMember]
    queues: _containers.RepeatedCompositeFieldContainer[GroupQueue]
    dlq_messages: int
    redeliveries: int
    shard: str
    def __init__(self, name: _Optional[str] = ..., generation: _Optional[int] = ..., rebalances: _Optional[int] = ..., members: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ..., queues: _Optional[_Iterable[_Union[GroupQueue, _Mapping]]] = ..., dlq_messages: _Optional[int] = ..., redeliveries: _Optional[int] = ..., shard: _Optional[str] = ...) -> None: ...

class DescribeGroupResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: GroupDescription
    def __init__(self, group: _Optional[_Union[GroupDescription, _Mapping]] = ...) -> None: ...

class ResetOffsetsRequest(_message.Message):
    __slots__ = ("group", "topic", "to", "value", "queue_offsets")
    class QueueOffsetsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    group: str
    topic: str
    to: ResetTo
    value: int
    queue_offsets: _containers.ScalarMap[int, int]
    def __init__(self, group: _Optional[str] = ..., topic: _Optional[str] = ..., to: _Optional[_Union[ResetTo, str]] = ..., value: _Optional[int] = ..., queue_offsets: _Optional[_Mapping[int, int]] = ...) -> None: ...

class ResetOffsetsResponse(_message.Message):
    __slots__ = ("offsets",)
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    offsets: _containers.RepeatedCompositeFieldContainer[CommittedOffset]
    def __init__(self, offsets: _Optional[_Iterable[_Union[CommittedOffset, _Mapping]]] = ...) -> None: ...

class DescribeTopicRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class QueueDescription(_message.Message):
    __slots__ = ("queue_id", "min_offset", "max_offset", "bytes", "local_min_offset", "tiered_end_offset", "shard", "master")
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_MIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIERED_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    queue_id: int
    min_offset: int
    max_offset: int
    bytes: int
    local_min_offset: int
    tiered_end_offset: int
    shard: str
    master: str
    def __init__(self, queue_id: _Optional[int] = ..., min_offset: _Optional[int] = ..., max_offset: _Optional[int] = ..., bytes: _Optional[int] = ..., local_min_offset: _Optional[int] = ..., tiered_end_offset: _Optional[int] = ..., shard: _Optional[str] = ..., master: _Optional[str] = ...) -> None: ...

class DescribeTopicResponse(_message.Message):
    __slots__ = ("name", "topic_id", "queues")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOPIC_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    topic_id: int
    queues: _containers.RepeatedCompositeFieldContainer[QueueDescription]
    def __init__(self, name: _Optional[str] = ..., topic_id: _Optional[int] = ..., queues: _Optional[_Iterable[_Union[QueueDescription, _Mapping]]] = ...) -> None: ...

class GetRoutesRequest(_message.Message):
    __slots__ = ("topics",)
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, topics: _Optional[_Iterable[str]] = ...) -> None: ...

class SegmentRoute(_message.Message):
    __slots__ = ("shard", "logical_start", "end", "state")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    shard: str
    logical_start: int
    end: int
    state: str
    def __init__(self, shard: _Optional[str] = ..., logical_start: _Optional[int] = ..., end: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class QueueSegments(_message.Message):
    __slots__ = ("queue", "segments")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    queue: int
    segments: _containers.RepeatedCompositeFieldContainer[SegmentRoute]
    def __init__(self, queue: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[SegmentRoute, _Mapping]]] = ...) -> None: ...

class TopicRoute(_message.Message):
    __slots__ = ("topic", "queue_shards", "moved")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_shards: _containers.RepeatedScalarFieldContainer[str]
    moved: _containers.RepeatedCompositeFieldContainer[QueueSegments]
    def __init__(self, topic: _Optional[str] = ..., queue_shards: _Optional[_Iterable[str]] = ..., moved: _Optional[_Iterable[_Union[QueueSegments, _Mapping]]] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("drain_shard", "undrain_shard", "dry_run", "timeout_ms")
    DRAIN_SHARD_FIELD_NUMBER: _ClassVar[int]
    UNDRAIN_SHARD_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    drain_shard: str
    undrain_shard: str
    dry_run: bool
    timeout_ms: int
    def __init__(self, drain_shard: _Optional[str] = ..., undrain_shard: _Optional[str] = ..., dry_run: _Optional[bool] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class RebalanceMove(_message.Message):
    __slots__ = ("topic", "queue_id", "from_shard", "to_shard", "duration_ms", "error")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_SHARD_FIELD_NUMBER: _ClassVar[int]
    TO_SHARD_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_id: int
    from_shard: str
    to_shard: str
    duration_ms: int
    error: str
    def __init__(self, topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., from_shard: _Optional[str] = ..., to_shard: _Optional[str] = ..., duration_ms: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("moves",)
    MOVES_FIELD_NUMBER: _ClassVar[int]
    moves: _containers.RepeatedCompositeFieldContainer[RebalanceMove]
    def __init__(self, moves: _Optional[_Iterable[_Union[RebalanceMove, _Mapping]]] = ...) -> None: ...

class ForwardedTimer(_message.Message):
    __slots__ = ("timer_offset", "key", "body", "props")
    TIMER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    PROPS_FIELD_NUMBER: _ClassVar[int]
    timer_offset: int
    key: bytes
    body: bytes
    props: bytes
    def __init__(self, timer_offset: _Optional[int] = ..., key: _Optional[bytes] = ..., body: _Optional[bytes] = ..., props: _Optional[bytes] = ...) -> None: ...

class ForwardTimersRequest(_message.Message):
    __slots__ = ("source_shard", "topic", "queue_id", "timers")
    SOURCE_SHARD_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMERS_FIELD_NUMBER: _ClassVar[int]
    source_shard: str
    topic: str
    queue_id: int
    timers: _containers.RepeatedCompositeFieldContainer[ForwardedTimer]
    def __init__(self, source_shard: _Optional[str] = ..., topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., timers: _Optional[_Iterable[_Union[ForwardedTimer, _Mapping]]] = ...) -> None: ...

class ForwardTimersResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class MoveQueueRequest(_message.Message):
    __slots__ = ("topic", "queue_id", "to_shard", "timeout_ms")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    TO_SHARD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_id: int
    to_shard: str
    timeout_ms: int
    def __init__(self, topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., to_shard: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class MoveQueueResponse(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentRoute]
    def __init__(self, segments: _Optional[_Iterable[_Union[SegmentRoute, _Mapping]]] = ...) -> None: ...

class MoveSlotRequest(_message.Message):
    __slots__ = ("slot", "to_shard", "timeout_ms")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    TO_SHARD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    to_shard: str
    timeout_ms: int
    def __init__(self, slot: _Optional[int] = ..., to_shard: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class MoveSlotResponse(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: str
    def __init__(self, shard: _Optional[str] = ...) -> None: ...

class ImportOffsetsRequest(_message.Message):
    __slots__ = ("slot", "source_shard", "offsets")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SHARD_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    source_shard: str
    offsets: _containers.RepeatedCompositeFieldContainer[CommittedOffset]
    def __init__(self, slot: _Optional[int] = ..., source_shard: _Optional[str] = ..., offsets: _Optional[_Iterable[_Union[CommittedOffset, _Mapping]]] = ...) -> None: ...

class ImportOffsetsResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class ShardRoute(_message.Message):
    __slots__ = ("shard", "master", "nodes", "epoch", "queues", "draining", "slots", "read_only_segments")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    shard: str
    master: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    epoch: int
    queues: int
    draining: bool
    slots: int
    read_only_segments: int
    def __init__(self, shard: _Optional[str] = ..., master: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., epoch: _Optional[int] = ..., queues: _Optional[int] = ..., draining: _Optional[bool] = ..., slots: _Optional[int] = ..., read_only_segments: _Optional[int] = ...) -> None: ...

class GetRoutesResponse(_message.Message):
    __slots__ = ("shard", "revision", "topics", "shards", "moves")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    shard: str
    revision: int
    topics: _containers.RepeatedCompositeFieldContainer[TopicRoute]
    shards: _containers.RepeatedCompositeFieldContainer[ShardRoute]
    moves: _containers.RepeatedCompositeFieldContainer[MoveInFlight]
    def __init__(self, shard: _Optional[str] = ..., revision: _Optional[int] = ..., topics: _Optional[_Iterable[_Union[TopicRoute, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[ShardRoute, _Mapping]]] = ..., moves: _Optional[_Iterable[_Union[MoveInFlight, _Mapping]]] = ...) -> None: ...

class MoveInFlight(_message.Message):
    __slots__ = ("topic", "queue_id", "from_shard", "to_shard")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_SHARD_FIELD_NUMBER: _ClassVar[int]
    TO_SHARD_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_id: int
    from_shard: str
    to_shard: str
    def __init__(self, topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., from_shard: _Optional[str] = ..., to_shard: _Optional[str] = ...) -> None: ...

class BeginTransactionRequest(_message.Message):
    __slots__ = ("transactional_id", "timeout_ms", "check_back", "count_messages", "begin_id", "coordinator", "group", "coordinator_epoch")
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CHECK_BACK_FIELD_NUMBER: _ClassVar[int]
    COUNT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BEGIN_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    timeout_ms: int
    check_back: bool
    count_messages: bool
    begin_id: int
    coordinator: str
    group: str
    coordinator_epoch: int
    def __init__(self, transactional_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., check_back: _Optional[bool] = ..., count_messages: _Optional[bool] = ..., begin_id: _Optional[int] = ..., coordinator: _Optional[str] = ..., group: _Optional[str] = ..., coordinator_epoch: _Optional[int] = ...) -> None: ...

class BeginTransactionResponse(_message.Message):
    __slots__ = ("producer_id", "epoch", "timeout_ms", "counted", "shard")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    epoch: int
    timeout_ms: int
    counted: bool
    shard: str
    def __init__(self, producer_id: _Optional[int] = ..., epoch: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., counted: _Optional[bool] = ..., shard: _Optional[str] = ...) -> None: ...

class EndTransactionRequest(_message.Message):
    __slots__ = ("transactional_id", "producer_id", "commit", "offsets", "messages_sent", "participants")
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    producer_id: int
    commit: bool
    offsets: _containers.RepeatedCompositeFieldContainer[CommittedOffset]
    messages_sent: int
    participants: _containers.RepeatedCompositeFieldContainer[TransactionParticipant]
    def __init__(self, transactional_id: _Optional[str] = ..., producer_id: _Optional[int] = ..., commit: _Optional[bool] = ..., offsets: _Optional[_Iterable[_Union[CommittedOffset, _Mapping]]] = ..., messages_sent: _Optional[int] = ..., participants: _Optional[_Iterable[_Union[TransactionParticipant, _Mapping]]] = ...) -> None: ...

class TransactionParticipant(_message.Message):
    __slots__ = ("shard", "producer_id", "messages_sent", "offsets")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    shard: str
    producer_id: int
    messages_sent: int
    offsets: _containers.RepeatedCompositeFieldContainer[CommittedOffset]
    def __init__(self, shard: _Optional[str] = ..., producer_id: _Optional[int] = ..., messages_sent: _Optional[int] = ..., offsets: _Optional[_Iterable[_Union[CommittedOffset, _Mapping]]] = ...) -> None: ...

class AddTransactionParticipantRequest(_message.Message):
    __slots__ = ("transactional_id", "producer_id", "participant")
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANT_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    producer_id: int
    participant: TransactionParticipant
    def __init__(self, transactional_id: _Optional[str] = ..., producer_id: _Optional[int] = ..., participant: _Optional[_Union[TransactionParticipant, _Mapping]] = ...) -> None: ...

class AddTransactionParticipantResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrepareTransactionRequest(_message.Message):
    __slots__ = ("transactional_id", "producer_id", "messages_sent", "offsets")
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    producer_id: int
    messages_sent: int
    offsets: _containers.RepeatedCompositeFieldContainer[CommittedOffset]
    def __init__(self, transactional_id: _Optional[str] = ..., producer_id: _Optional[int] = ..., messages_sent: _Optional[int] = ..., offsets: _Optional[_Iterable[_Union[CommittedOffset, _Mapping]]] = ...) -> None: ...

class PrepareTransactionResponse(_message.Message):
    __slots__ = ("prepared", "reason")
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    prepared: bool
    reason: str
    def __init__(self, prepared: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class DecideTransactionRequest(_message.Message):
    __slots__ = ("transactional_id", "producer_id", "commit", "offsets")
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    producer_id: int
    commit: bool
    offsets: _containers.RepeatedCompositeFieldContainer[CommittedOffset]
    def __init__(self, transactional_id: _Optional[str] = ..., producer_id: _Optional[int] = ..., commit: _Optional[bool] = ..., offsets: _Optional[_Iterable[_Union[CommittedOffset, _Mapping]]] = ...) -> None: ...

class DecideTransactionResponse(_message.Message):
    __slots__ = ("outcome", "reason")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    outcome: TransactionOutcome
    reason: str
    def __init__(self, outcome: _Optional[_Union[TransactionOutcome, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class EndTransactionResponse(_message.Message):
    __slots__ = ("outcome", "reason")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    outcome: TransactionOutcome
    reason: str
    def __init__(self, outcome: _Optional[_Union[TransactionOutcome, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class TransactionQueue(_message.Message):
    __slots__ = ("topic", "queue_id", "first_offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue_id: int
    first_offset: int
    def __init__(self, topic: _Optional[str] = ..., queue_id: _Optional[int] = ..., first_offset: _Optional[int] = ...) -> None: ...

class TransactionInfo(_message.Message):
    __slots__ = ("transactional_id", "producer_id", "state", "age_ms", "write_age_ms", "timeout_ms", "queues", "reason", "checks")
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    WRITE_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    producer_id: int
    state: str
    age_ms: int
    write_age_ms: int
    timeout_ms: int
    queues: _containers.RepeatedCompositeFieldContainer[TransactionQueue]
    reason: str
    checks: int
    def __init__(self, transactional_id: _Optional[str] = ..., producer_id: _Optional[int] = ..., state: _Optional[str] = ..., age_ms: _Optional[int] = ..., write_age_ms: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., queues: _Optional[_Iterable[_Union[TransactionQueue, _Mapping]]] = ..., reason: _Optional[str] = ..., checks: _Optional[int] = ...) -> None: ...

class ListTransactionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTransactionsResponse(_message.Message):
    __slots__ = ("transactions",)
    TRANSACTIONS_FIELD_NUMBER: _ClassVar[int]
    transactions: _containers.RepeatedCompositeFieldContainer[TransactionInfo]
    def __init__(self, transactions: _Optional[_Iterable[_Union[TransactionInfo, _Mapping]]] = ...) -> None: ...

class DescribeTransactionRequest(_message.Message):
    __slots__ = ("transactional_id",)
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    def __init__(self, transactional_id: _Optional[str] = ...) -> None: ...

class DescribeTransactionResponse(_message.Message):
    __slots__ = ("transaction",)
    TRANSACTION_FIELD_NUMBER: _ClassVar[int]
    transaction: TransactionInfo
    def __init__(self, transaction: _Optional[_Union[TransactionInfo, _Mapping]] = ...) -> None: ...

class AbortTransactionRequest(_message.Message):
    __slots__ = ("transactional_id",)
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    def __init__(self, transactional_id: _Optional[str] = ...) -> None: ...

class AbortTransactionResponse(_message.Message):
    __slots__ = ("transaction",)
    TRANSACTION_FIELD_NUMBER: _ClassVar[int]
    transaction: TransactionInfo
    def __init__(self, transaction: _Optional[_Union[TransactionInfo, _Mapping]] = ...) -> None: ...

class TransactionCheckAnswer(_message.Message):
    __slots__ = ("transactional_ids", "producer_id", "decision", "transactional_id")
    TRANSACTIONAL_IDS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    transactional_ids: _containers.RepeatedScalarFieldContainer[str]
    producer_id: int
    decision: str
    transactional_id: str
    def __init__(self, transactional_ids: _Optional[_Iterable[str]] = ..., producer_id: _Optional[int] = ..., decision: _Optional[str] = ..., transactional_id: _Optional[str] = ...) -> None: ...

class TransactionCheck(_message.Message):
    __slots__ = ("transactional_id", "producer_id", "attempt")
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    producer_id: int
    attempt: int
    def __init__(self, transactional_id: _Optional[str] = ..., producer_id: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class EpochEntry(_message.Message):
    __slots__ = ("epoch", "start_offset")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    start_offset: int
    def __init__(self, epoch: _Optional[int] = ..., start_offset: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol_version", "cluster_id", "node_id", "epochs", "log_end", "address")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    LOG_END_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    cluster_id: str
    node_id: str
    epochs: _containers.RepeatedCompositeFieldContainer[EpochEntry]
    log_end: int
    address: str
    def __init__(self, protocol_version: _Optional[int] = ..., cluster_id: _Optional[str] = ..., node_id: _Optional[str] = ..., epochs: _Optional[_Iterable[_Union[EpochEntry, _Mapping]]] = ..., log_end: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("flushed_offset", "coordinator_unreachable_ms", "heard_sent_at_us")
    FLUSHED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_UNREACHABLE_MS_FIELD_NUMBER: _ClassVar[int]
    HEARD_SENT_AT_US_FIELD_NUMBER: _ClassVar[int]
    flushed_offset: int
    coordinator_unreachable_ms: int
    heard_sent_at_us: int
    def __init__(self, flushed_offset: _Optional[int] = ..., coordinator_unreachable_ms: _Optional[int] = ..., heard_sent_at_us: _Optional[int] = ...) -> None: ...

class SlaveMessage(_message.Message):
    __slots__ = ("hello", "ack")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    ack: ReplicaAck
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., ack: _Optional[_Union[ReplicaAck, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("cluster_id", "node_id", "epochs", "truncate_to", "log_start", "client_address")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_TO_FIELD_NUMBER: _ClassVar[int]
    LOG_START_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    node_id: str
    epochs: _containers.RepeatedCompositeFieldContainer[EpochEntry]
    truncate_to: int
    log_start: int
    client_address: str
    def __init__(self, cluster_id: _Optional[str] = ..., node_id: _Optional[str] = ..., epochs: _Optional[_Iterable[_Union[EpochEntry, _Mapping]]] = ..., truncate_to: _Optional[int] = ..., log_start: _Optional[int] = ..., client_address: _Optional[str] = ...) -> None: ...

class Data(_message.Message):
    __slots__ = ("start_offset", "batches", "confirm_offset", "epoch", "master_end", "sent_at_us")
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MASTER_END_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_US_FIELD_NUMBER: _ClassVar[int]
    start_offset: int
    batches: bytes
    confirm_offset: int
    epoch: int
    master_end: int
    sent_at_us: int
    def __init__(self, start_offset: _Optional[int] = ..., batches: _Optional[bytes] = ..., confirm_offset: _Optional[int] = ..., epoch: _Optional[int] = ..., master_end: _Optional[int] = ..., sent_at_us: _Optional[int] = ...) -> None: ...

class MasterMessage(_message.Message):
    __slots__ = ("welcome", "data")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    data: Data
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., data: _Optional[_Union[Data, _Mapping]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("cluster_id", "protocol_version")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    protocol_version: int
    def __init__(self, cluster_id: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("path", "offset", "data", "crc32c", "manifest_json")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    crc32c: int
    manifest_json: str
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., manifest_json: _Optional[str] = ...) -> None: ...
