"""`python -m pyctl`: the `gpufault` command (pyctl/entry.py).

`python -S -m pyctl` starts without `site` (on the dev VM its `.pth`
hooks, an editable install's finder and a sandbox's certifi import, were
25-35 ms of every start; a clean venv's `site` ~2 ms): the site-packages
directories go on sys.path as `site` puts them there, without running
their `.pth` files. Where the dependencies are not found that way (an
editable install of one, a path a `.pth` adds), `site` runs after all,
as without -S: never a start that fails for the want of it.
"""

from __future__ import annotations

import sys

# What a `trace` or `inject` imports from site-packages (pyproject's
# dependencies on the start path).
NEEDED = ("click", "rust_demangler")


def _venv() -> tuple[str, bool] | None:
    """(prefix, system site-packages too) of the venv this interpreter
    runs in, read from its pyvenv.cfg as site.venv() reads it; None
    outside one."""
    import os  # lazy: `python -S -m pyctl` only (this module stays import-free for -S)

    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    prefix = os.path.dirname(exe_dir)
    for conf in (os.path.join(exe_dir, "pyvenv.cfg"), os.path.join(prefix, "pyvenv.cfg")):
        if os.path.isfile(conf):
            system = True
            with open(conf, encoding="utf-8") as f:
                for line in f:
                    key, eq, value = line.partition("=")
                    if eq and key.strip().lower() == "include-system-site-packages":
                        system = value.strip().lower() == "true"
            return prefix, system
    return None


def site_paths() -> None:
    """Under -S: the directories `site` would add (a venv's first, the
    user's, the interpreter's) on sys.path, or `site` run after all."""
    # lazy: only under -S, which exists to start without these
    import os
    import site
    from importlib.machinery import PathFinder

    before = (list(sys.path), sys.prefix, sys.exec_prefix)
    venv = _venv()
    dirs: list[str] = []
    user = site.check_enableusersite()
    if venv is not None:  # as site.venv(): the venv is sys.prefix from here on
        sys.prefix = sys.exec_prefix = venv[0]
        dirs += site.getsitepackages([venv[0]])
        user = user and venv[1]
    if user:
        dirs.append(site.getusersitepackages())
    if venv is None or venv[1]:
        dirs += site.getsitepackages([sys.base_prefix, sys.base_exec_prefix])
    sys.path.extend(d for d in dict.fromkeys(dirs) if d not in sys.path and os.path.isdir(d))
    if any(PathFinder.find_spec(m) is None for m in NEEDED):
        sys.path[:], sys.prefix, sys.exec_prefix = before
        site.main()


if sys.flags.no_site:
    site_paths()

from pyctl.entry import main  # noqa: E402 - after the paths it may need

if __name__ == "__main__":
    main()
