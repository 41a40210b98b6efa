"""Extract the uncompressed vmlinux ELF from a bzImage.

qemu boots an ELF vmlinux that carries a Xen PVH entry note directly, which
skips SeaBIOS's Linux loader and, above all, the kernel's self-decompression:
under TCG, unpacking Debian's xz bzImage costs several CPU-seconds per boot."""

from __future__ import annotations

import lzma
import shutil
import struct
import subprocess
from pathlib import Path

_PVH_NOTE = 18  # XEN_ELFNOTE_PHYS32_ENTRY


def payload(bzimage: bytes) -> bytes:
    """The compressed kernel inside a bzImage (boot protocol >= 2.08)."""
    if bzimage[0x202:0x206] != b"HdrS":
        raise ValueError("not a bzImage (no HdrS boot header)")
    setup_sects = bzimage[0x1F1] or 4
    offset, length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sects + 1) * 512 + offset
    return bzimage[start : start + length]


def decompress(data: bytes) -> bytes:
    if data.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMADecompressor().decompress(data)
    if data.startswith(b"\x28\xb5\x2f\xfd"):
        if shutil.which("zstd") is None:
            raise ValueError("zstd-compressed kernel and no zstd tool (apt-get install zstd)")
        # The payload ends with the uncompressed size, which zstd reads as
        # trailing garbage: take the output and ignore that complaint.
        proc = subprocess.run(["zstd", "-dc"], input=data, capture_output=True)
        return proc.stdout
    raise ValueError("unsupported kernel compression (want xz or zstd)")


def has_pvh_note(elf: bytes) -> bool:
    """Whether an x86-64 ELF carries the PVH entry note qemu needs."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        return False
    phoff = struct.unpack_from("<Q", elf, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(phnum):
        p_type, _, off, _, _, filesz = struct.unpack_from("<IIQQQQ", elf, phoff + i * phentsize)
        if p_type != 4:  # PT_NOTE
            continue
        pos, end = off, off + filesz
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, pos)
            name = elf[pos + 12 : pos + 12 + namesz].rstrip(b"\0")
            if name == b"Xen" and ntype == _PVH_NOTE:
                return True
            pos += 12 + (namesz + 3) // 4 * 4 + (descsz + 3) // 4 * 4
    return False


def extract(vmlinuz: Path, dest: Path) -> bool:
    """Write dest when vmlinuz holds a PVH-bootable ELF; False otherwise
    (the caller then boots the bzImage)."""
    try:
        elf = decompress(payload(vmlinuz.read_bytes()))
    except ValueError:
        return False
    if not has_pvh_note(elf):
        return False
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(elf)
    tmp.replace(dest)
    return True
