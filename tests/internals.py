"""What the tests read of refshare's private state, where nothing public can show it.

Every private name the suite needs comes from here, so that a redesign of the package
changes this file and not the tests. Each name says why a test needs it.
"""

from __future__ import annotations

from refshare import _job as job_writer  # each process's report file, and its role
from refshare._admission import (  # the counts that decide what is keyed
    COLD_AFTER,
    MAX_KINDS,
    PROBE_EVERY,
    Admission,
    kind,
)
from refshare._boot import Chain, Method, merged_runtime_env  # refshare run's setup
from refshare._cache import process_cache  # the process-wide cache, to count its entries
from refshare._clocks import SENDS as sends_clock  # the audit's clock, shared by threads
from refshare._clocks import SharedClock
from refshare._hashing import PARALLEL_MIN_BYTES, digest_buffer  # the chunked digest
from refshare._hashing import _get_pool as hashing_pool  # its helper threads, to keep busy
from refshare._integrations import FRAMEWORKS, _enabled  # the frameworks enable() knows
from refshare._integrations.framework import Framework, Target
from refshare._integrations.skyrl import register_tensor_batch  # a mirror keyed as SkyRL's
from refshare._job_report import JobReport, read_job  # a job's files read back as one
from refshare._keys import identify  # keying with a memo of one's own, as a call does
from refshare._keys import leaves as leaf_digests  # which hash ran (by name)
from refshare._keys.pickler import SERIALIZE_OBJECT_ARRAYS_FROM, _digest_array_list
from refshare._keys.sizes import SCALAR_BYTES, SIZE_VISIT_BUDGET, _ndarray_size, measure
from refshare._keys.stamps import _seen as digests_kept_across_calls
from refshare._keys.stamps import (
    array_trust,
    first_put,  # keying as a call's first ray.put of a value
)
from refshare._keys.tables import Memo, Trust
from refshare._ledger import Ledger  # an audit's ledger, to time a call by hand
from refshare._ray import submit  # Ray's patch targets, to pretend Ray moved them
from refshare._scope import memo as call_memo  # what a call keys with, to make it fail
from refshare._scope import store as call_store  # what a call stores with, to make Ray refuse it
from refshare._wire import serialized  # Ray's pickler, to pretend it is not as expected
from refshare._wire.tensors import TensorElements  # a tensor sent as its own elements

__all__ = [
    "COLD_AFTER",
    "FRAMEWORKS",
    "MAX_KINDS",
    "PARALLEL_MIN_BYTES",
    "PROBE_EVERY",
    "SCALAR_BYTES",
    "SERIALIZE_OBJECT_ARRAYS_FROM",
    "SIZE_VISIT_BUDGET",
    "Admission",
    "Chain",
    "Framework",
    "JobReport",
    "Ledger",
    "Memo",
    "Method",
    "SharedClock",
    "Target",
    "TensorElements",
    "Trust",
    "_digest_array_list",
    "_enabled",
    "_ndarray_size",
    "array_trust",
    "call_memo",
    "call_store",
    "digest_buffer",
    "digests_kept_across_calls",
    "first_put",
    "hashing_pool",
    "identify",
    "job_writer",
    "kind",
    "leaf_digests",
    "measure",
    "merged_runtime_env",
    "process_cache",
    "read_job",
    "register_tensor_batch",
    "sends_clock",
    "serialized",
    "submit",
]
