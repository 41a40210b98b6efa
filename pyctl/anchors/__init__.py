"""Client for the gpufa kernel module: /dev/gpufa anchor records, the fault
context ioctl, and storage of records in SQLite keyed by fault ID."""

from pyctl.anchors.device import AnchorDevice
from pyctl.anchors.ingest import Ingest
from pyctl.anchors.record import AnchorRecord, decode, fault_id_text, parse_fault_id
from pyctl.anchors.store import by_fault, store_records

__all__ = [
    "AnchorDevice",
    "AnchorRecord",
    "Ingest",
    "by_fault",
    "decode",
    "fault_id_text",
    "parse_fault_id",
    "store_records",
]
