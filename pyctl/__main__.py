"""`python -m pyctl`: the `gpufault` command (pyctl/entry.py).

`python -S -m pyctl` starts without `site` (on the dev VM its `.pth`
hooks, an editable install's finder and a sandbox's certifi import, were
20-27 ms of every start; a clean venv's `site` ~2 ms): the site-packages
directories go on sys.path as `site` puts them there, without running
their `.pth` files. Where the dependencies are not found that way (an
editable install of one, a path a `.pth` adds), `site` runs after all,
as without -S: never a start that fails for the want of it.
"""

import sys

# What a `trace` or `inject` imports from site-packages (pyproject's
# dependencies on the start path).
NEEDED = ("click", "rust_demangler")


def site_paths() -> None:
    """Under -S: site-packages on sys.path, or `site` run after all."""
    import site
    from importlib.machinery import PathFinder

    before = list(sys.path)
    dirs = [site.getusersitepackages()] if site.check_enableusersite() else []
    dirs += site.getsitepackages()
    sys.path.extend(d for d in dirs if d not in sys.path)
    if any(PathFinder.find_spec(m) is None for m in NEEDED):
        sys.path[:] = before
        site.main()


if sys.flags.no_site:
    site_paths()

from pyctl.entry import main  # noqa: E402 - after the paths it may need

if __name__ == "__main__":
    main()
