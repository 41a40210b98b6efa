"""The smallest experiment file the parser takes (a url and pid target,
1 s phases), for tests of one table's keys: header(NAME) + the table."""

from __future__ import annotations


def header(name: str) -> str:
    return f"""
name = "{name}"
version = 1
title = "t"
[target]
url = "http://127.0.0.1:9"
pid = 1
[phases]
baseline = "1s"
method = "1s"
"""
