"""The tokenizer fault campaigns (classes 9-12) from Python, as `gpufault
tokenizer` runs them: resolve a target, open a campaign (a run in the
store whose findings become its faults), run fuzz, race, cache or
truncation against it; and the entry points of the installed tokenizer
libraries, counted in a running process with tracefs uprobes.

    t = tokenizer.resolve_target("hf")
    with tokenizer.campaign("fuzz", db, target=t) as rec:
        rep = tokenizer.run_fuzz(t, tokenizer.fuzz_cases(t.specials), recorder=rec)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from pyctl.exceptions import BadInput, MissingPrerequisite

NO_DB_RUN = "nodb0000"  # the run id a campaign without a store records under


def resolve_target(spec: str, **kw: Any) -> Any:
    """A tokenizer target: hf | tiktoken (built in-process from generated
    data), module:callable, or http://host:port/path. Raises ValueError,
    TypeError or ImportError (BadInput: TargetError) for one that cannot work."""
    # lazy: keeps pyctl.tokenizer.targets (+36 modules, ~200 ms) off `--help` and `import gpufault`
    from pyctl.tokenizer.targets import resolve_target as resolve

    return resolve(spec, **kw)


def entry_of(target: Any) -> str:
    """The entry point a campaign's encode reaches: the library's own
    method (through any weakened wrapper), the callable, or the endpoint."""
    # lazy: keeps pyctl.tokenizer.targets (+36 modules, ~200 ms) off `--help` and `import gpufault`
    from pyctl.tokenizer import targets

    base = target
    while hasattr(base, "inner"):
        base = base.inner
    if isinstance(base, targets.HFTarget):
        return "tokenizers.Tokenizer.encode"
    if isinstance(base, targets.TiktokenTarget):
        return "tiktoken.Encoding.encode"
    if isinstance(base, targets.HttpTarget):
        return f"POST {base.path}"
    name = getattr(base, "name", "target")
    return f"{name}.encode" if hasattr(getattr(base, "obj", None), "encode") else name


# The demo wrappers that make a healthy target fail its campaign
# (pyctl/tokenizer/weakened.py), by the campaign they fail.
_WEAK = {
    "fuzz": ("WeakLossyTokenizer", {}),
    "race": ("WeakUnsyncCacheTokenizer", {}),
    "cache": ("WeakLruCacheTokenizer", {"capacity": 128, "miss_cost_s": 50e-6}),
    "truncation": ("WeakOffByOneCollator", {}),
}


def weaken(target: Any, campaign: str) -> Any:
    """target wrapped in the weakness `campaign` finds (a demo: lossy
    encode, an unsynchronised cache, a small LRU cache, an off-by-one
    collator)."""
    # lazy: keeps pyctl.tokenizer.weakened (+3 modules) off `--help` and `import gpufault`
    from pyctl.tokenizer import weakened

    if campaign not in _WEAK:
        raise BadInput(
            f"weaken: no weakened target for {campaign!r}: give one of {', '.join(_WEAK)}"
        )
    cls, kw = _WEAK[campaign]
    return getattr(weakened, cls)(target, **kw)


class Campaign:
    """A campaign's run: opened at construction (the store, the run, its
    spec), a Recorder inside `with`, closed (done or failed) at its end."""

    def __init__(
        self,
        campaign: str,
        db: str | os.PathLike[str] | None,
        *,
        no_db: bool = False,
        keep_text: bool = False,
        target: Any = None,
        function: str = "encode",
        argv: Sequence[str] = (),
    ) -> None:
        # lazy: keeps pyctl.tokenizer.record (+29 modules, ~200 ms) off `import gpufault`
        from pyctl.tokenizer.record import Recorder

        library = getattr(target, "name", None)
        if function == "encode" and target is not None:
            function = entry_of(target)
        self.db: Any = None
        self.run_id = NO_DB_RUN
        if no_db:
            self.recorder = Recorder(
                None, NO_DB_RUN, campaign, keep_text, function=function, library=library
            )
            return
        # lazy: keeps pyctl.evidence.store (+27 modules, ~100 ms) off `import gpufault`
        from pyctl.evidence import layers, store

        path = db or store.DEFAULT_DB
        try:
            self.db = store.open_db(path)
        except OSError as e:
            raise MissingPrerequisite(
                f"cannot open store {path}: {e} (use --db PATH or --no-db)"
            ) from e
        argv = list(argv)
        self.run_id = store.new_run(self.db, argv, f"tokenizer:{campaign}")
        layers.add_spec(
            self.db,
            self.run_id,
            0,
            f"tokenizer {campaign} --target {library or '?'}: {function}",
            {"campaign": campaign, "target": library, "function": function, "argv": argv[1:]},
        )
        self.recorder = Recorder(
            self.db, self.run_id, campaign, keep_text, function=function, library=library
        )

    def __enter__(self) -> Any:
        return self.recorder

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.db is None:
            return
        # lazy: keeps pyctl.evidence.store (+26 modules, ~100 ms) off `import gpufault`
        from pyctl.evidence import store

        status, code = ("failed", 1) if exc_type is not None else ("done", 0)
        rec = self.recorder
        rec.flush()
        store.end_run(
            self.db, self.run_id, status, code, {"cases": rec.seq, "findings": rec.findings}
        )


def campaign(campaign: str, db: str | os.PathLike[str] | None, **kw: Any) -> Campaign:
    """Campaign(campaign, db, no_db=, keep_text=, target=, function=, argv=)."""
    return Campaign(campaign, db, **kw)


def fuzz_cases(
    specials: Iterable[str], *, max_len: int = 100_000, categories: Sequence[str] | None = None
) -> list[Any]:
    """Class 9's cases: adversarial Unicode and deep-BPE inputs (ValueError
    for an unknown category)."""
    # lazy: keeps pyctl.tokenizer.unicode (+69 modules, ~300 ms) off `--help` and `import gpufault`
    from pyctl.tokenizer import unicode

    specials = list(specials) or ["<|endoftext|>"]
    return list(unicode.generate_cases(specials, max_len=max_len, categories=categories))


def run_fuzz(target: Any, cases: Sequence[Any], **kw: Any) -> Any:
    """Class 9: pyctl.tokenizer.unicode.run_fuzz (recorder=, slow_factor=, progress=)."""
    # lazy: keeps pyctl.tokenizer.unicode (+69 modules, ~300 ms) off `--help` and `import gpufault`
    from pyctl.tokenizer import unicode

    return unicode.run_fuzz(target, cases, **kw)


def run_race(target: Any, **kw: Any) -> Any:
    """Class 11: pyctl.tokenizer.race.run_race (threads=, calls_per_thread=,
    stall_us=, seed=, recorder=, progress=)."""
    # lazy: keeps pyctl.tokenizer.race (+31 modules, ~200 ms) off `--help` and `import gpufault`
    from pyctl.tokenizer import race

    return race.run_race(target, **kw)


def run_cache(target: Any, **kw: Any) -> Any:
    """Class 12: pyctl.tokenizer.cache.run_cache (requests=, flood_ratio=,
    factor=, seed=, recorder=, progress=)."""
    # lazy: keeps pyctl.tokenizer.cache (+33 modules, ~200 ms) off `--help` and `import gpufault`
    from pyctl.tokenizer import cache

    return cache.run_cache(target, **kw)


def run_truncation(target: Any, **kw: Any) -> Any:
    """Class 10: pyctl.tokenizer.truncation.run_truncation (max_length=,
    corrupt=, rate=, seed=, recorder=, progress=)."""
    # lazy: keeps pyctl.tokenizer.truncation (+31 modules) off `--help`, `import gpufault`
    from pyctl.tokenizer import truncation

    return truncation.run_truncation(target, **kw)


def entry_point_reports() -> list[Any]:
    """What `tokenizer probes` lists: per tokenizer library, where its wheel
    is and the entry points found (or why not)."""
    # lazy: keeps pyctl.symbols.tokenizers (+14 modules, ~100 ms) off `--help` and `import gpufault`
    from pyctl.symbols import tokenizers as symbols

    return [symbols.report(lib) for lib in symbols.MODULES]


def report_json(r: Any) -> dict[str, Any]:
    """One of entry_point_reports() as `tokenizer probes --json` writes it."""
    return {
        "library": r.library,
        "path": r.path,
        "symtab": r.symtab,
        "dynsym": r.dynsym,
        "found": {k: [e._asdict() for e in v] for k, v in r.found.items()},
        "missing": r.missing,
        "note": r.note,
    }


def short_name(name: str, width: int = 40) -> str:
    """A demangled name with its generics collapsed, cut at the front to width."""
    # lazy: keeps pyctl.symbols.tokenizers (+14 modules, ~100 ms) off `--help` and `import gpufault`
    from pyctl.symbols.tokenizers import collapse_generics

    name = collapse_generics(name)
    return name if len(name) <= width else "..." + name[-(width - 3) :]


def libraries_of_pid(pid: int) -> dict[str, Path]:
    """The tokenizer libraries process pid maps, by name; BadInput when the
    process cannot be read."""
    # lazy: keeps pyctl.symbols.tokenizers (+14 modules, ~100 ms) off `--help` and `import gpufault`
    from pyctl.symbols import tokenizers as symbols

    try:
        return dict(symbols.libraries_of_pid(pid))
    except LookupError as e:
        raise BadInput(str(e)) from e


def entry_points(
    libs: dict[str, Any],
    kinds: Sequence[str] = (),
    on_skip: Callable[[str, Exception], None] | None = None,
) -> list[Any]:
    """The entry points of `kinds` (default: every encode kind) in libs;
    a kind that cannot be found goes to on_skip(kind, why)."""
    # lazy: keeps pyctl.symbols.tokenizers (+14 modules, ~100 ms) off `--help` and `import gpufault`
    from pyctl.symbols import tokenizers as symbols

    points: list[Any] = []
    for lib, path in libs.items():
        for kind in kinds or [k for k in symbols.kinds_for(lib) if "encode" in k]:
            if symbols.KINDS.get(kind) and symbols.KINDS[kind].library != lib:
                continue
            try:
                points += symbols.find_entry_points(path, kind)
            except (LookupError, KeyError) as e:
                if on_skip is not None:
                    on_skip(kind, e)
    return points


def count_calls(points: Sequence[Any], seconds: float) -> list[int]:
    """Hits of each entry point over `seconds`, counted with tracefs uprobes
    (per library file: every process mapping it is counted). Raises
    PermissionError without root, TracefsError without tracefs."""
    # lazy: keeps pyctl.tokenizer.uprobe_count (+22 modules) off `--help`, `import gpufault`
    from pyctl.tokenizer.uprobe_count import UprobeCounter

    with UprobeCounter(list(points)) as c:
        time.sleep(seconds)  # the observation window itself, not a synchronisation
        hits = c.counts()
    return [hits[i] for i in range(len(points))]


__all__ = [
    "NO_DB_RUN",
    "Campaign",
    "campaign",
    "count_calls",
    "entry_of",
    "entry_point_reports",
    "entry_points",
    "fuzz_cases",
    "libraries_of_pid",
    "report_json",
    "resolve_target",
    "run_cache",
    "run_fuzz",
    "run_race",
    "run_truncation",
    "short_name",
    "weaken",
]
