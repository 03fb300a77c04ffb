"""The `make bench` harness: each stage timed against its peer and its physical limit, in one process tree.

A pair is three callables over one prepared input: `ours`, `peer` and (optionally) `limit`. The harness runs them
alternately (ours, peer, limit, ours, peer, limit, ...) so that a load change on a shared machine hits both sides
alike, and reports each side's median and spread ((max - min) / median). Only ratios from one run mean much here.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

COLUMNS = ("stage", "ours", "peer", "ratio", "limit", "share of limit")
JSON_KEYS = ("stage", "ours_s", "peer_s", "ratio", "limit_s", "share_of_limit")


@dataclass
class Pair:
    """One stage: our implementation, its nearest peer and the machine's limit for the same work."""

    stage: str
    ours: Callable[[], object]
    peer: Callable[[], object]
    limit: Optional[Callable[[], object]] = None
    peer_name: str = ""  # what the peer is, in words (printed under the table)
    limit_name: str = ""
    # Called once after the timed runs with the last outputs of ours and the peer; raises when they differ.
    check: Optional[Callable[[object, object], None]] = None
    # A limit computed rather than timed (e.g. FLOPs at a measured matmul rate): seconds, called once at the end.
    limit_seconds: Optional[Callable[[], float]] = None
    # Called once when the pair is done (or has failed): releases what its construction holds (process groups).
    close: Optional[Callable[[], None]] = None


@dataclass
class Timings:
    """Wall seconds of every run of one side."""

    seconds: list = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """(max - min) / median: how much the runs disagree."""
        return (max(self.seconds) - min(self.seconds)) / self.median if self.median > 0 else 0.0


@dataclass
class Row:
    """One line of the table and of bench.json."""

    stage: str
    ours_s: float
    peer_s: float
    ratio: float  # peer_s / ours_s: above 1 means ours is faster
    limit_s: Optional[float]
    share_of_limit: Optional[float]  # limit_s / ours_s: 1.0 means ours runs at the machine's limit
    ours_spread: float = 0.0
    peer_spread: float = 0.0
    runs: int = 0
    peer_name: str = ""
    limit_name: str = ""

    def as_json(self) -> dict:
        return asdict(self)


def make_row(pair: Pair, ours: Timings, peer: Timings, limit_s: Optional[float]) -> Row:
    """The row of one pair's timings (the ratio and share defined once, here)."""
    ours_s, peer_s = ours.median, peer.median
    return Row(
        stage=pair.stage,
        ours_s=ours_s,
        peer_s=peer_s,
        ratio=peer_s / ours_s,
        limit_s=limit_s,
        share_of_limit=None if limit_s is None else limit_s / ours_s,
        ours_spread=ours.spread,
        peer_spread=peer.spread,
        runs=len(ours.seconds),
        peer_name=pair.peer_name,
        limit_name=pair.limit_name,
    )


def _timed(fn: Callable[[], object]) -> tuple:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run_pair(pair: Pair, runs: int = 3, warmup: int = 1, say=print) -> Row:
    """Time one pair: `warmup` untimed rounds, then `runs` alternating rounds; check outputs; return the row."""
    try:
        if runs < 1:
            raise ValueError(f"--runs must be at least 1, got {runs}.")
        return _run_pair(pair, runs, warmup, say)
    finally:
        if pair.close is not None:
            pair.close()


def _run_pair(pair: Pair, runs: int, warmup: int, say) -> Row:
    ours, peer, limit = Timings(), Timings(), Timings()
    last_ours = last_peer = None
    for round_index in range(warmup + runs):
        timed = round_index >= warmup
        seconds, last_ours = _timed(pair.ours)
        if timed:
            ours.seconds.append(seconds)
        seconds, last_peer = _timed(pair.peer)
        if timed:
            peer.seconds.append(seconds)
        if pair.limit is not None:
            seconds, _ = _timed(pair.limit)
            if timed:
                limit.seconds.append(seconds)
        say(f"  {pair.stage}: round {round_index + 1}/{warmup + runs}{'' if timed else ' (warm-up)'} done")
    if pair.check is not None:
        pair.check(last_ours, last_peer)
    limit_s = limit.median if limit.seconds else (pair.limit_seconds() if pair.limit_seconds else None)
    return make_row(pair, ours, peer, limit_s)


def _seconds(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.3f} s"


def format_table(rows: list) -> str:
    """The one table: stage | ours | peer | ratio | limit | share of limit (markdown, medians with spread)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [
            r.stage,
            f"{r.ours_s:.3f} s ±{100 * r.ours_spread:.0f}%",
            f"{r.peer_s:.3f} s ±{100 * r.peer_spread:.0f}%",
            f"{r.ratio:.2f}×",
            _seconds(r.limit_s),
            "—" if r.share_of_limit is None else f"{100 * r.share_of_limit:.0f}%",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r.stage}: peer = {r.peer_name}" + (f"; limit = {r.limit_name}" if r.limit_name else "") for r in rows]
    return "\n".join(lines + [""] + notes)


def write_json(rows: list, path: Path) -> Path:
    """bench.json: the rows as a list of objects (written atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([r.as_json() for r in rows], indent=1) + "\n")
    os.replace(tmp, path)
    return path
