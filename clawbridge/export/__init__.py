"""Exports other tools read: recorded turns as chat JSONL, token-level JSONL / Parquet and a
Hugging Face `datasets` folder (`records` computes, `formats` writes)."""

from clawbridge.export.formats import FORMATS, ExportFormat
from clawbridge.export.records import ExportFilter, export_records

__all__ = ["FORMATS", "ExportFilter", "ExportFormat", "export_records"]
