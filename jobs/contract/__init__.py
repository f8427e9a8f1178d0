"""The one vocabulary shared by the panel and the jobs: the run spec, derived values and the store layout."""

from jobs.contract import derived, layout
from jobs.contract.durations import duration, timeout_seconds
from jobs.contract.spec import (
    BUILTIN_ENVIRONMENTS,
    BUILTIN_REWARDS,
    DEMO_DATASET_ID,
    DEMO_MODEL_ID,
    SCHEMA_VERSION,
    VLLM_LORA_RANKS,
    ComputeSpec,
    DatasetSpec,
    EnvironmentSpec,
    EvalSpec,
    GrpoSpec,
    LoraSpec,
    ModelSpec,
    ParentSpec,
    RewardSpec,
    RunSpec,
    SpecError,
    StorageSpec,
    parse_spec,
)
from jobs.contract.storage_uri import StorageLocation, parse_storage_uri

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "BUILTIN_REWARDS",
    "DEMO_DATASET_ID",
    "DEMO_MODEL_ID",
    "SCHEMA_VERSION",
    "VLLM_LORA_RANKS",
    "ComputeSpec",
    "DatasetSpec",
    "EnvironmentSpec",
    "EvalSpec",
    "GrpoSpec",
    "LoraSpec",
    "ModelSpec",
    "ParentSpec",
    "RewardSpec",
    "RunSpec",
    "SpecError",
    "StorageLocation",
    "StorageSpec",
    "derived",
    "duration",
    "layout",
    "parse_spec",
    "parse_storage_uri",
    "timeout_seconds",
]
