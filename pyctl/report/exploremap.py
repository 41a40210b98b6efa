"""An exploration's resilience map as a section of `gpufault experiment
report` (issue 24): `experiment report EXPLORATION_ID` reports the map and
then every trial's experiment, each map row linking to its section.

Read from the store's rows (`explorations` and the `explore_map` view,
docs/schema.md), not from pyctl.explore: the report is a floor below the
exploration (docs/layers.md), and the rows are what it wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import Any

from pyctl.symbols.tokenizers import collapse_generics


@dataclass
class ExploreMap:
    id: str
    file: str
    status: str
    points: int
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def experiment_ids(self) -> list[str]:
        """The trials' experiments, in trial order (the ones that ran)."""
        return [r["experiment_id"] for r in self.rows if r.get("experiment_id")]


def short_function(name: str) -> str:
    """A Rust or C++ name as its last type and function, generics dropped
    (`<tokenizers::tokenizer::TokenizerImpl<..5 params..>>::encode_char_offsets::<EncodeInput>`
    -> `TokenizerImpl::encode_char_offsets`): a map's column (the points'
    list keeps the full name). Also `gpufault explore report`'s."""
    if "::" not in name:
        return name
    n = collapse_generics(name).replace("<..>", "")
    parts = [p for p in n.replace("<", "").replace(">", "").split("::") if p]
    return "::".join(parts[-2:]) or name


def load_map(db: Any, ident: str) -> ExploreMap | None:
    """The exploration `ident` (None when it is not one: an experiment id)."""
    row = db.conn.execute(
        "SELECT id, file, status, points FROM explorations WHERE id = ?", (ident,)
    ).fetchone()
    if row is None:
        return None
    cur = db.conn.execute(
        "SELECT idx, point, function, site, calls, action, code, outcome, recover_s, "
        "fires, experiment_id, reason FROM explore_map WHERE exploration_id = ? ORDER BY idx",
        (ident,),
    )
    names = [c[0] for c in cur.description]
    rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    return ExploreMap(row[0], row[1] or "", row[2] or "", row[3] or 0, rows)


def _fault(r: dict[str, Any]) -> str:
    if r["action"] == "fail":
        return str(r["code"])
    return "hang" if r["code"] == "hang" else f"stall {r['code']}"


def _recover(r: dict[str, Any]) -> str:
    return "" if r["recover_s"] is None else f"{float(r['recover_s']):.2f}s"


def _site(site: str) -> str:
    return site.rsplit("/", 1)[-1]


def map_html(m: ExploreMap) -> str:
    bad = {"SLO broken", "crashed", "hung", "did not recover"}
    rows = []
    for r in m.rows:
        cls = "fail" if r["outcome"] in bad else "pass" if r["outcome"] == "tolerated" else ""
        eid = r.get("experiment_id") or ""
        link = f'<a href="#exp-{escape(eid)}"><code>{escape(eid)}</code></a>' if eid else ""
        rows.append(
            f"<tr><td class='num'>{r['idx']}</td><td><code>{escape(r['point'])}</code></td>"
            f"<td>{escape(short_function(r['function'] or '?'))}</td>"
            f"<td><code>{escape(_site(r['site'] or '?'))}</code></td>"
            f"<td class='num'>{r['calls'] or 0}</td><td>{escape(_fault(r))}</td>"
            f'<td class="{cls}" title="{escape(r["reason"] or "")}">{escape(r["outcome"])}</td>'
            f"<td class='num'>{_recover(r)}</td><td>{link}</td></tr>"
        )
    return (
        f'<section class="experiment" id="map-{escape(m.id)}">'
        f"<h2>Resilience map: exploration {escape(m.id)}</h2>"
        f"<p>{escape(m.file)}; status {escape(m.status)}; {m.points} point(s) found, "
        f"{len(m.rows)} trial(s) run. Each trial's experiment follows.</p>"
        "<table><thead><tr><th>#</th><th>point</th><th>function</th><th>caller site</th>"
        "<th>calls</th><th>fault</th><th>outcome</th><th>recover</th><th>experiment</th>"
        "</tr></thead><tbody>" + "".join(rows) + "</tbody></table></section>"
    )


def map_md(m: ExploreMap) -> list[str]:
    out = [
        f"## Resilience map: exploration {m.id}",
        "",
        f"{m.file}; status {m.status}; {m.points} point(s) found, {len(m.rows)} trial(s) run.",
        "",
        "| # | point | function | caller site | calls | fault | outcome | recover | experiment |",
        "|---:|---|---|---|---:|---|---|---:|---|",
    ]
    for r in m.rows:
        out.append(
            f"| {r['idx']} | `{r['point']}` | {short_function(r['function'] or '?')} | "
            f"`{_site(r['site'] or '?')}` | {r['calls'] or 0} | {_fault(r)} | "
            f"**{r['outcome']}** | {_recover(r)} | `{r.get('experiment_id') or ''}` |"
        )
    return [*out, ""]
