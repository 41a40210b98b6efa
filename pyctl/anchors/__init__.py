"""Client for the gpufa kernel module: /dev/gpufa anchor records and the
fault context ioctl. Their storage in SQLite, keyed by fault ID, is
evidence, a floor above: pyctl/evidence/anchors.py (store_records,
by_fault) and pyctl/evidence/anchor_ingest.py (Ingest)."""

from pyctl.anchors.device import AnchorDevice
from pyctl.anchors.record import AnchorRecord, decode, fault_id_text, parse_fault_id

__all__ = [
    "AnchorDevice",
    "AnchorRecord",
    "decode",
    "fault_id_text",
    "parse_fault_id",
]
