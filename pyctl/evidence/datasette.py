"""Datasette metadata for the evidence store: pyctl/evidence/datasette.json.

    datasette serve /var/lib/gpufault/gpufault.db \\
        --metadata "$(python -c 'import pyctl.evidence.datasette as d; print(d.PATH)')"

Table, view and column descriptions come from docs/schema.md's one-line
meanings (the page tests/test_schema.py keeps equal to the live schema),
so a Datasette user reads what the schema page says; the canned queries
are below. `python -m pyctl.evidence.datasette` writes the file again
from the docs (tests/test_datasette.py fails while the two differ); `--name
NAME` prints it for a database file not called gpufault.db (Datasette
keys metadata by the file's stem).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

PATH = Path(__file__).with_name("datasette.json")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "schema.md"
DB_NAME = "gpufault"  # the default --db, /var/lib/gpufault/gpufault.db

# Canned queries: Datasette shows each as a form (:name parameters).
QUERIES: dict[str, dict[str, str]] = {
    "fault_chain": {
        "title": "Fault chain",
        "description": "Everything known about one fault, as `gpufault show` prints it: "
        "the call, its arguments, registers, stack, Python frames, and what followed "
        "(links, Xids, anchors).",
        "sql": """WITH chain(part, rank, n, what, value) AS (
  SELECT 'fault', 0, 0, function || ' #' || call_seq || ' ' || action || ' via ' || mechanism,
         coalesce('injected ' || coalesce(retval_name, retval), '') ||
         coalesce(' (injected: ' || injected || ')', '') ||
         coalesce(', returned ' || coalesce(ret_name, ret), '')
    FROM faults_readable WHERE fault_id = :fault_id
  UNION ALL SELECT 'arg', 1, idx, name, coalesce(decoded, raw)
    FROM args_readable WHERE fault_id = :fault_id
  UNION ALL SELECT 'register', 2, 0, reg, value
    FROM registers_readable WHERE fault_id = :fault_id
  UNION ALL SELECT 'frame', 3, depth, address, symbol
    FROM stacks_readable WHERE fault_id = :fault_id
  UNION ALL SELECT 'python frame', 4, depth, function, file || ':' || coalesce(line, '?')
    FROM pyframes WHERE fault_id = :fault_id
  UNION ALL SELECT 'followed: ' || kind, 5, id, rule, what
    FROM links_readable WHERE fault_id = :fault_id
  UNION ALL SELECT 'xid', 6, id, rule, 'Xid ' || error_code || ' on ' || dev || ': ' || msg
    FROM xids WHERE fault_id = :fault_id
  UNION ALL SELECT 'anchor', 7, id, kind, coalesce(bdf, '') || ' code ' || coalesce(code, '')
    FROM anchors WHERE fault_id = :fault_id
)
SELECT part, n, what, value FROM chain ORDER BY rank, n, what""",
    },
    "calls_per_function": {
        "title": "Calls per function of a run",
        "description": "Per probed function of one run: calls, completed calls, mean and "
        "max latency (`gpufault calls RUN` has percentiles and histograms).",
        "sql": """SELECT fn.symbol AS function, fn.library, count(*) AS calls,
       sum(c.kind = 1) AS returned, round(avg(CASE WHEN c.kind = 1 THEN c.latency_ns END) / 1e3, 1)
       AS mean_us, round(max(c.latency_ns) / 1e3, 1) AS max_us,
       count(DISTINCT c.tid) AS threads
  FROM calls c LEFT JOIN funcs fn ON fn.run_id = c.run_id AND fn.func = c.func
 WHERE c.run_id = :run_id AND c.kind IN (1, 2)
 GROUP BY c.func ORDER BY calls DESC""",
    },
    "faults_per_run": {
        "title": "Faults per run",
        "description": "Every run, newest first: what ran, how it ended, its faults and links.",
        "sql": """SELECT r.run_id, r.kind, strftime('%Y-%m-%d %H:%M:%S', r.started, 'unixepoch')
       AS started_utc, r.status, r.exit_code, r.mechanism,
       (SELECT count(*) FROM faults f WHERE f.run_id = r.run_id) AS faults,
       (SELECT count(*) FROM links l WHERE l.run_id = r.run_id) AS links,
       (SELECT count(*) FROM xids x WHERE x.run_id = r.run_id) AS xids
  FROM runs r ORDER BY r.started DESC""",
    },
    "experiments_with_verdicts": {
        "title": "Experiments and their verdicts",
        "description": "Every chaos experiment, newest first, with its verdict, its steps "
        "and how many faults they fired.",
        "sql": """SELECT e.id, e.name, e.version, strftime('%Y-%m-%d %H:%M:%S', e.started_at,
       'unixepoch') AS started_utc, e.verdict, e.reason,
       count(s.idx) AS steps, sum(s.fires) AS fires
  FROM experiments e LEFT JOIN experiment_steps s ON s.experiment_id = e.id
 GROUP BY e.id ORDER BY e.started_at DESC""",
    },
    "slo_alerts": {
        "title": "Burn-rate SLO alerts of an experiment",
        "description": "Each [[slo]] alert pair of one experiment: its worst long and short "
        "burn rates, when it first fired (seconds after the experiment started, and in which "
        "phase) and in how many 1 s windows.",
        "sql": """SELECT b.slo_id, b.alert, max(b.long_burn) AS worst_long_burn,
       max(b.short_burn) AS worst_short_burn,
       round(min(CASE WHEN b.firing THEN b.at END) - e.started_at, 1) AS first_fired_s,
       (SELECT f.phase FROM slo_burns f WHERE f.experiment_id = b.experiment_id
           AND f.slo_id = b.slo_id AND f.alert = b.alert AND f.firing
         ORDER BY f.at LIMIT 1) AS first_fired_phase,
       sum(b.firing) AS firing_windows
  FROM slo_burns b JOIN experiments e ON e.id = b.experiment_id
 WHERE b.experiment_id = :experiment_id
 GROUP BY b.slo_id, b.alert ORDER BY b.slo_id, b.alert""",
    },
    "explorations": {
        "title": "Explorations and their resilience maps",
        "description": "Every `gpufault explore` run, newest first: points found, trials run, "
        "and how many trials ended in each outcome (the map itself: the explore_map view).",
        "sql": """SELECT x.id, x.file, strftime('%Y-%m-%d %H:%M:%S', x.started_at, 'unixepoch')
       AS started_utc, x.status, x.points, count(t.idx) AS trials,
       sum(t.outcome = 'tolerated') AS tolerated,
       sum(t.outcome = 'degraded within SLO') AS degraded,
       sum(t.outcome = 'SLO broken') AS slo_broken,
       sum(t.outcome IN ('crashed', 'hung', 'did not recover')) AS crashed_hung_unrecovered,
       sum(t.outcome IN ('not reached', 'error')) AS not_reached_or_error
  FROM explorations x LEFT JOIN explore_trials t ON t.exploration_id = x.id
 GROUP BY x.id ORDER BY x.started_at DESC""",
    },
}


def parse_docs(text: str) -> dict[str, dict[str, Any]]:
    """{table or view: {"description", "columns": {name: meaning}}} from
    docs/schema.md: `## table` / `### view` headings, the paragraph under
    them, `- `col`: meaning` (tables) and `* `col`: meaning` (views)."""
    out: dict[str, dict[str, Any]] = {}
    cur: dict[str, Any] | None = None
    para: list[str] = []
    for ln in text.splitlines():
        if ln.startswith("# "):
            cur = None  # "# Views": its prose is about every view
        elif m := re.match(r"#{2,3} (\w+)\s*$", ln):
            cur = out.setdefault(m.group(1), {"description": "", "columns": {}})
            para = []
        elif cur is not None and (m := re.match(r"[-*] `(\w+)`: (.+)$", ln)):
            if not cur["description"]:
                cur["description"] = " ".join(para)
            cur["columns"][m.group(1)] = m.group(2).strip()
        elif cur is not None and not cur["columns"] and ln.strip():
            para.append(ln.strip())
    return out


def metadata(db_name: str = DB_NAME, docs: str | None = None) -> dict[str, Any]:
    tables = parse_docs(DOCS.read_text() if docs is None else docs)
    return {
        "title": "gpufault evidence",
        "description": "Faults, calls, links, Xids and experiments recorded by gpufault "
        "(docs/schema.md). The *_readable views show addresses in hex and codes by name.",
        "databases": {
            db_name: {
                "description": "One gpufault evidence store; a fault ID is <run_id>-<seq>.",
                "tables": tables,
                "queries": QUERIES,
            }
        },
    }


def render(db_name: str = DB_NAME) -> str:
    return json.dumps(metadata(db_name), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", help="print the metadata for a database of this name (file stem)")
    a = ap.parse_args(argv)
    if a.name:
        # From the shipped file: an installed wheel has no docs/ to read.
        doc = json.loads(PATH.read_text())
        doc["databases"] = {a.name: doc["databases"][DB_NAME]}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        PATH.write_text(render())
        print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
