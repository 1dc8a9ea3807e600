"""The session store: transcripts, token logs, images and global-KV chunks in one
SQLite file (WAL, zstd frames), plus the RAM pool for sliding-window state.

Owns: persistence and integrity of what it is handed. Does not own: the model, the
meaning of KV bytes, recomputing KV, or printing; it imports neither `model`,
`tools` nor `dsagent`.
"""

from .blob import DEFAULT_ZSTD_LEVEL, FORMAT_VERSION, ImageSpan, KVChunk
from .errors import (
    BlobError, NotADatabase, SchemaTooNew, SessionDamaged, SessionExists, SessionInUse, SessionNotFound, StoreError,
    StoreFull, StoreReadOnly,
)
from .integrity import RepairPlan
from .manage import GcResult, PruneResult, SessionStorage, StorageReport, VerifyResult
from .pool import LocalStatePool, ResumePlan, plan_resume
from .store import DB_NAME, Loaded, Prefix, SaveResult, SessionInfo, Store, default_home

__all__ = [
    "DB_NAME", "DEFAULT_ZSTD_LEVEL", "FORMAT_VERSION", "BlobError", "GcResult", "ImageSpan",
    "KVChunk", "LocalStatePool", "Loaded", "NotADatabase", "Prefix", "PruneResult", "RepairPlan", "ResumePlan",
    "SaveResult", "SchemaTooNew", "SessionDamaged", "SessionExists", "SessionInUse", "SessionInfo",
    "SessionNotFound", "SessionStorage", "StorageReport", "Store", "StoreError", "StoreFull",
    "StoreReadOnly", "VerifyResult", "default_home", "plan_resume",
]
