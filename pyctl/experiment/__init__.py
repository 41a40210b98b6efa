"""Chaos experiments against a live inference service (issue 14).

files (the TOML experiment files), runner (baseline -> method -> recovery
-> after, rollbacks always), host (FaultHost: where a fault runs; today a
child controller per step on this machine), evidence (the SQLite rows,
EXPERIMENT_DDL), verdict (pass | fail | aborted | error) and cli (`gpufault
experiment`) use loadgen (open-loop HTTP load), stats (Mann-Whitney U
judge, recovery time) and probes (steady-state checks with tolerances).
docs/experiments.md describes them.
"""
