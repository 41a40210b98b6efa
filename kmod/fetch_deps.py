#!/usr/bin/env python3
"""Fetch what the kmod build tests need beyond the VM kernels, into build/kmod/.

  checkpatch  scripts/checkpatch.pl (+ spelling.txt, const_structs.checkpatch)
              out of Debian's linux-source-6.1 package -> build/kmod/checkpatch/
  k612        bookworm's newest 6.12 headers + kbuild  -> build/kmod/k612/
  k72         sid's headers + kbuild for the sid VM kernel, and sid's C
              library: its kbuild tools need a newer one than bookworm's, so
              each tool is wrapped to run under sid's dynamic loader
                                                         -> build/kmod/k72/

Each kernel dir gets a `kdir` file naming the headers directory. Idempotent.
Uses apt-get download with the machine's configured sources (and, for sid,
the private apt configuration that vm/fetch_kernels.py keeps).

  python3 kmod/fetch_deps.py              # all three
  python3 kmod/fetch_deps.py checkpatch
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "build" / "kmod"
CHECKPATCH_FILES = ("checkpatch.pl", "spelling.txt", "const_structs.checkpatch")


class FetchError(Exception):
    pass


def sh(argv: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise FetchError(f"{' '.join(argv[:4])} failed: {tail}")
    return proc.stdout


def depends(opts: list[str], pkg: str, pattern: str) -> str:
    for line in sh(["apt-cache", *opts, "depends", pkg]).splitlines():
        m = re.match(r"\s*\|?Depends: (\S+)", line)
        if m and re.fullmatch(pattern, m.group(1)):
            return m.group(1)
    raise FetchError(f"{pkg} has no dependency matching {pattern}; run apt-get update")


def download(opts: list[str], pkgs: list[str], dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    sh(["apt-get", *opts, "-o", "APT::Sandbox::User=root", "download", *pkgs], cwd=dest)
    return sorted(dest.glob("*.deb"))


def fetch_checkpatch() -> Path:
    dest = OUT / "checkpatch"
    if all((dest / f).exists() for f in CHECKPATCH_FILES):
        return dest
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        t = Path(tmp)
        (deb,) = download([], ["linux-source-6.1"], t)
        sh(["dpkg-deb", "-x", str(deb), str(t / "x")])
        (src,) = (t / "x").glob("usr/src/linux-source-*.tar.xz")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(src) as tar:
            for m in tar:
                name = m.name.split("/", 1)[-1]
                if name in (f"scripts/{f}" for f in CHECKPATCH_FILES):
                    f = tar.extractfile(m)
                    assert f is not None
                    (dest / Path(name).name).write_bytes(f.read())
                    if all((dest / x).exists() for x in CHECKPATCH_FILES):
                        break
    (dest / "checkpatch.pl").chmod(0o755)
    return dest


def fix_headers(root: Path) -> Path:
    """Point the headers' Makefile at the extracted tree; return the kdir."""
    (kdir,) = [
        p for p in (root / "usr/src").glob("linux-headers-*") if not p.name.endswith("-common")
    ]
    mk = kdir / "Makefile"
    mk.write_text(re.sub(r"(?<![\w/])/usr/src/", f"{root}/usr/src/", mk.read_text()))
    return kdir


def fetch_kernel(name: str, opts: list[str], headers_pkg: str) -> Path:
    dest = OUT / name
    if (dest / "kdir").exists() and Path((dest / "kdir").read_text().strip()).is_dir():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    release = headers_pkg.removeprefix("linux-headers-")
    pkgs = [
        headers_pkg,
        depends(opts, headers_pkg, r"linux-headers-.*-common"),
        depends(opts, headers_pkg, r"linux-kbuild-.*"),
    ]
    debs = download(opts, pkgs, dest / "deb")
    for deb in debs:
        sh(["dpkg-deb", "-x", str(deb), str(dest / "root")])
    shutil.rmtree(dest / "deb")
    kdir = fix_headers(dest / "root")
    (dest / "release").write_text(release + "\n")
    (dest / "kdir").write_text(f"{kdir}\n")
    return dest


def fetch_k612() -> Path:
    pkg = depends([], "linux-headers-6.12-amd64", r"linux-headers-6\.12\..*-amd64")
    return fetch_kernel("k612", [], pkg)


def wrap_tools(kbuild: Path, libdir: Path) -> int:
    """Run every ELF tool under kbuild/ with the C library in libdir: the
    binary moves to NAME.bin and NAME becomes a shell wrapper that starts it
    through that library's loader, keeping argv[0] (modpost execs siblings
    named after it)."""
    loader = libdir / "ld-linux-x86-64.so.2"
    n = 0
    for f in sorted(kbuild.rglob("*")):
        if not f.is_file() or f.is_symlink() or f.suffix == ".bin":
            continue
        with f.open("rb") as fh:
            if fh.read(4) != b"\x7fELF":
                continue
        binary = f.with_name(f.name + ".bin")
        f.rename(binary)
        f.write_text(
            f'#!/bin/sh\nexec {loader} --library-path {libdir} --argv0 "$0" {binary} "$@"\n'
        )
        f.chmod(0o755)
        n += 1
    return n


def fetch_k72() -> Path:
    sys.path.insert(0, str(REPO / "vm"))
    import fetch_kernels  # type: ignore[import-not-found]

    rel_file = REPO / "build" / "vm" / "sid" / "release"
    if not rel_file.exists():
        raise FetchError("the sid VM kernel is not fetched; run `python3 vm/fetch_kernels.py sid`")
    opts = fetch_kernels.private_apt("sid")
    dest = OUT / "k72"
    if (dest / "libc").is_dir():
        return dest
    fetch_kernel("k72", opts, f"linux-headers-{rel_file.read_text().strip()}")
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        (deb,) = download(opts, ["libc6"], Path(tmp))
        sh(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "x")])
        shutil.move(str(Path(tmp) / "x" / "usr" / "lib" / "x86_64-linux-gnu"), dest / "libc")
    (kbuild,) = (dest / "root" / "usr" / "lib").glob("linux-kbuild-*")
    wrap_tools(kbuild, (dest / "libc").resolve())
    return dest


STEPS = {"checkpatch": fetch_checkpatch, "k612": fetch_k612, "k72": fetch_k72}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="*", help=f"any of {', '.join(STEPS)} (default: all)")
    args = ap.parse_args()
    bad = [w for w in args.what if w not in STEPS]
    if bad:
        print(f"fetch_deps: unknown {bad[0]!r}; use any of {', '.join(STEPS)}", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    rc = 0
    for name in args.what or list(STEPS):
        try:
            print(f"  {name}: {STEPS[name]()}")
        except FetchError as e:
            print(f"fetch_deps: {name}: {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
