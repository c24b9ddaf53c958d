"""The scheduler: requests, KV-cache block management and the step loop's decisions. No torch here."""

from scheduler.config import SchedulerConfig, SchedulerStats
from scheduler.outputs import (
    CachedRequestData,
    KVImport,
    KVPart,
    KVTransfer,
    KVTransferError,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SampledLogprobs,
    SchedulerOutput,
    merge_deltas,
    pack_outputs,
    unpack_outputs,
)
from scheduler.request import EngineRequest, Request, RequestStatus
from scheduler.sampling_params import RequestError, SamplingParams, StructuredOutputsParams
from scheduler.scheduler import Scheduler

__all__ = [
    "CachedRequestData",
    "EngineRequest",
    "KVImport",
    "KVPart",
    "KVTransfer",
    "KVTransferError",
    "ModelRunnerOutput",
    "NewRequestData",
    "Request",
    "RequestError",
    "RequestOutput",
    "RequestStatus",
    "SampledLogprobs",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "StructuredOutputsParams",
    "merge_deltas",
    "pack_outputs",
    "unpack_outputs",
]
