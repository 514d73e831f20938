"""Tuning tables: persisted autotuning results and the cfg=None choice (see `tables`)."""
from .tables import (SCHEMA, SEQ_BUCKETS, TuningEntry, TuningTable, TuningTableError, clear_caches, default_table_path,
                     default_tables_dir, device_arch_name, device_family, device_name, device_slug, explain_choice, pick_bucket,
                     tuned_config, user_table_path)

__all__ = [
    "SEQ_BUCKETS", "SCHEMA", "TuningEntry", "TuningTable", "TuningTableError", "pick_bucket",
    "device_slug", "device_family", "user_table_path", "default_tables_dir", "default_table_path",
    "tuned_config", "explain_choice", "device_name", "device_arch_name", "clear_caches",
]
