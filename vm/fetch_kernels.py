#!/usr/bin/env python3
"""Fetch the VM test kernels into build/vm/ (idempotent; `make vm-kernels`).

  bookworm  Debian 12's generic amd64 kernel (the current candidate of
            linux-image-amd64 in the machine's own apt sources) plus its
            headers and kbuild, extracted so out-of-tree modules build
            against build/vm/bookworm/kdir.
  sid       Debian sid's generic amd64 kernel (linux-binary-* and
            linux-modules-*), through a private apt configuration under
            build/vm/apt whose mirror is copied at run time from the
            machine's configured Debian source.

Each kernel dir holds vmlinuz, release (the uname -r string), version (the
Debian package version) and modules/ (the 9p/virtio modules, decompressed,
with their load order in modules/order). Example:

  python3 vm/fetch_kernels.py            # both
  python3 vm/fetch_kernels.py sid        # one
  python3 vm/fetch_kernels.py --refresh bookworm
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kmodules  # noqa: E402
import vmlinux  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VMDIR = REPO / "build" / "vm"
KERNELS = ("bookworm", "sid")


class FetchError(Exception):
    """A fetch step failed; the message says what to do."""


def sh(argv: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise FetchError(f"{' '.join(argv[:3])} ... failed: {' / '.join(tail)}")
    return proc.stdout


# --- the machine's Debian mirror --------------------------------------------


def _deb822_entries(text: str) -> list[dict[str, str]]:
    entries = []
    for block in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, val = line.partition(":")
            fields[key.strip().lower()] = val.strip()
        if fields:
            entries.append(fields)
    return entries


def system_mirror() -> tuple[str, str]:
    """(URI, keyring) of the machine's main Debian archive source: the entry
    whose suites are plain releases (not -security, not -updates)."""
    src = Path("/etc/apt/sources.list.d")
    for path in sorted(src.glob("*.sources")) if src.is_dir() else []:
        for e in _deb822_entries(path.read_text()):
            if "deb" not in e.get("types", "").split() or e.get("enabled", "yes") == "no":
                continue
            suites = e.get("suites", "").split()
            if any("-" not in s for s in suites) and "/debian" in e.get("uris", ""):
                keyring = e.get("signed-by", "/usr/share/keyrings/debian-archive-keyring.gpg")
                return e["uris"].split()[0], keyring
    legacy = Path("/etc/apt/sources.list")
    if legacy.is_file():
        for line in legacy.read_text().splitlines():
            m = re.match(r"deb\s+(?:\[[^\]]*\]\s+)?(\S+/debian)/?\s+([a-z]+)\s", line)
            if m:
                return m.group(1), "/usr/share/keyrings/debian-archive-keyring.gpg"
    raise FetchError("no Debian archive source found in /etc/apt; configure one and retry")


# --- apt helpers ------------------------------------------------------------

SYSTEM_APT: list[str] = ["-o", "APT::Sandbox::User=root"]


def private_apt(suite: str) -> list[str]:
    """apt options for a private configuration under build/vm/apt/<suite>
    that reads nothing of the machine's own apt state."""
    base = VMDIR / "apt" / suite
    for d in ("lists/partial", "cache/archives/partial", "preferences.d", "apt.conf.d"):
        (base / d).mkdir(parents=True, exist_ok=True)
    uri, keyring = system_mirror()
    (base / "sources.list").write_text(f"deb [signed-by={keyring}] {uri} {suite} main\n")
    return SYSTEM_APT + [
        "-o", f"Dir::State::Lists={base / 'lists'}",
        "-o", f"Dir::Etc::sourcelist={base / 'sources.list'}",
        "-o", "Dir::Etc::sourceparts=-",
        "-o", f"Dir::Etc::preferencesparts={base / 'preferences.d'}",
        "-o", f"Dir::Etc::parts={base / 'apt.conf.d'}",
        "-o", f"Dir::Cache={base / 'cache'}",
        "-o", "Dir::State::status=/dev/null",
        "-o", "APT::Architecture=amd64",
        "-o", "Debug::NoLocking=1",
    ]  # fmt: skip


def meta_release(opts: list[str]) -> str:
    """The kernel release that linux-image-amd64 currently points to."""
    out = sh(["apt-cache", *opts, "depends", "linux-image-amd64"])
    m = re.search(r"Depends: linux-image-(\d\S*-amd64)\s", out)
    if not m:
        raise FetchError(
            "linux-image-amd64 has no linux-image-<release> dependency; "
            "run apt-get update and retry"
        )
    return m.group(1)


def candidate(opts: list[str], pkg: str) -> str:
    out = sh(["apt-cache", *opts, "policy", pkg])
    m = re.search(r"Candidate: (\S+)", out)
    if not m or m.group(1) == "(none)":
        raise FetchError(f"{pkg} has no install candidate; run apt-get update and retry")
    return m.group(1)


def depends_on(opts: list[str], pkg: str, pattern: str) -> str:
    out = sh(["apt-cache", *opts, "depends", pkg])
    m = re.search(rf"Depends: ({pattern})\s", out)
    if not m:
        raise FetchError(f"{pkg} does not depend on {pattern}; package layout changed")
    return m.group(1)


def download(opts: list[str], pkgs: list[str], dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    sh(["apt-get", *opts, "download", *pkgs], cwd=dest)
    return sorted(dest.glob("*.deb"))


def extract(debs: list[Path], root: Path) -> None:
    for deb in debs:
        sh(["dpkg-deb", "-x", str(deb), str(root)])


# --- per kernel -------------------------------------------------------------


def find_vmlinuz(root: Path, release: str) -> Path:
    for cand in (
        root / "boot" / f"vmlinuz-{release}",
        root / "usr/lib/modules" / release / "vmlinuz",
        root / "lib/modules" / release / "vmlinuz",
    ):
        if cand.is_file():
            return cand
    raise FetchError(f"no vmlinuz for {release} in the extracted packages")


def find_moddir(root: Path, release: str) -> Path:
    for cand in (root / "lib/modules" / release, root / "usr/lib/modules" / release):
        if (cand / "kernel").is_dir():
            return cand
    raise FetchError(f"no modules for {release} in the extracted packages")


def fix_headers(root: Path, release: str) -> Path:
    """Debian's headers Makefile includes /usr/src/linux-headers-*-common by
    absolute path; point it at the extracted copy."""
    kdir = root / "usr/src" / f"linux-headers-{release}"
    mk = kdir / "Makefile"
    text = mk.read_text()
    fixed = re.sub(r"include /usr/src/", f"include {root}/usr/src/", text)
    if fixed == text:
        raise FetchError(f"{mk}: no /usr/src include to rewrite; package layout changed")
    mk.write_text(fixed)
    return kdir


def fetch_one(kernel: str, final: Path, work: Path) -> str:
    """Download and lay out one kernel in work/, with paths written as they
    will be once work/ is renamed to final/. Returns the release."""
    if kernel == "bookworm":
        opts = SYSTEM_APT
        release = meta_release(opts)
        version = candidate(opts, f"linux-image-{release}")
        common = depends_on(opts, f"linux-headers-{release}", r"linux-headers-\S+-common")
        kbuild = depends_on(opts, f"linux-headers-{release}", r"linux-kbuild-\S+")
        pkgs = [f"linux-image-{release}", f"linux-headers-{release}", common, kbuild]
    else:
        opts = private_apt("sid")
        print("  sid: apt-get update (private lists under build/vm/apt/sid)")
        sh(["apt-get", *opts, "update"])
        release = meta_release(opts)
        version = candidate(opts, f"linux-image-{release}")
        pkgs = [f"linux-binary-{release}", f"linux-modules-{release}"]
    print(f"  {kernel}: {release} ({version}): {' '.join(pkgs)}")
    debs = download(opts, [f"{p}={version}" for p in pkgs], work / "debs")
    extract(debs, work / "root")
    shutil.rmtree(work / "debs")
    shutil.copy2(find_vmlinuz(work / "root", release), work / "vmlinuz")
    add_vmlinux(work)
    names = kmodules.stage(find_moddir(work / "root", release), work / "modules")
    print(f"  {kernel}: guest modules: {' '.join(names) or '(all built in)'}")
    if kernel == "bookworm":
        fix_headers(work / "root", release)
        # Rewritten for the final location: the include above must name it.
        mk = work / "root/usr/src" / f"linux-headers-{release}" / "Makefile"
        mk.write_text(mk.read_text().replace(str(work), str(final)))
        (work / "kdir").write_text(f"{final}/root/usr/src/linux-headers-{release}\n")
    (work / "version").write_text(version + "\n")
    # Written last: its presence marks a complete fetch.
    (work / "release").write_text(release + "\n")
    return release


def add_vmlinux(kdir: Path) -> None:
    """The uncompressed, PVH-bootable kernel next to vmlinuz (faster boots)."""
    if (kdir / "vmlinux").exists():
        return
    if vmlinux.extract(kdir / "vmlinuz", kdir / "vmlinux"):
        print(f"  {kdir.name}: vmlinux extracted (PVH boot, no decompression under TCG)")
    else:
        print(f"  {kdir.name}: no PVH-bootable vmlinux; booting the bzImage")


def complete(kdir: Path, kernel: str) -> bool:
    need = ["release", "vmlinuz", "modules/order"] + (["kdir"] if kernel == "bookworm" else [])
    return all((kdir / n).exists() for n in need)


def fetch(kernel: str, refresh: bool = False) -> str:
    final = VMDIR / kernel
    if complete(final, kernel) and not refresh:
        release = (final / "release").read_text().strip()
        print(f"  {kernel}: have {release} (--refresh to fetch again)")
        add_vmlinux(final)  # trees fetched before vmlinux extraction existed
        return release
    work = VMDIR / f".{kernel}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        release = fetch_one(kernel, final, work)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(work, final)
    return release


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernels", nargs="*", help="bookworm and/or sid (default: both)")
    ap.add_argument("--refresh", action="store_true", help="fetch again even if present")
    args = ap.parse_args(argv)
    bad = [k for k in args.kernels if k not in KERNELS]
    if bad:
        print(f"fetch-kernels: unknown kernel {bad[0]!r}; use bookworm or sid", file=sys.stderr)
        return 2
    try:
        for k in args.kernels or KERNELS:
            fetch(k, args.refresh)
    except FetchError as e:
        print(f"fetch-kernels: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
