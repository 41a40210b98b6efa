"""tools/bundle-libs.sh finds the host's libbpf and libelf through ldconfig,
whatever the length of the loader cache (CI once failed with Error 141: the
lookup stopped reading, ldconfig died of SIGPIPE and pipefail failed it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "bundle-libs.sh"


def _fake_ldconfig(bin_dir: Path, libs: dict[str, Path], padding_lines: int) -> None:
    """An ldconfig whose -p lists the given libraries first and then more
    entries than a pipe's buffer holds, so a reader that stops early kills it."""
    lines = [f"\t{name} (libc6,x86-64) => {path}" for name, path in libs.items()]
    body = "\n".join(lines)
    script = bin_dir / "ldconfig"
    script.write_text(
        "#!/bin/sh\n"
        f"printf '%d libs found in cache\\n' {len(libs) + padding_lines}\n"
        f"cat <<'LIST'\n{body}\nLIST\n"
        f"i=0; while [ $i -lt {padding_lines} ]; do "
        'echo "\tlibpad$i.so.1 (libc6,x86-64) => /nonexistent/libpad$i.so.1"; '
        "i=$((i+1)); done\n"
    )
    script.chmod(0o755)


def test_a_loader_cache_longer_than_a_pipe_buffer(tmp_path: Path) -> None:
    libs = {}
    for name in ("libbpf.so.1", "libelf.so.1"):
        lib = tmp_path / "src" / name
        lib.parent.mkdir(exist_ok=True)
        lib.write_bytes(b"\x7fELF" + name.encode())
        libs[name] = lib
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # ~70 bytes a line: 4000 lines is about 4x a 64 KiB pipe buffer.
    _fake_ldconfig(bin_dir, libs, padding_lines=4000)
    dest = tmp_path / "dest"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", str(SCRIPT), str(dest)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    for name, lib in libs.items():
        assert (dest / name).read_bytes() == lib.read_bytes()
    assert sorted(p.name for p in dest.iterdir()) == sorted(libs)


def test_a_missing_library_is_one_line(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_ldconfig(bin_dir, {}, padding_lines=10)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "dest")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "bundle-libs: libbpf.so.1 not found: apt-get install libbpf1 libelf1"
    ]
