"""Render an :class:`~tiertrain.estimate.memory.Estimate` for people (a table) and
programs (JSON)."""

from __future__ import annotations

import json
from typing import Any

from tiertrain.estimate.memory import TIERS, Estimate

__all__ = ["human_bytes", "render_table", "to_json"]


def human_bytes(n: float) -> str:
    """Binary units, three significant digits: 0 B, 512 B, 1.50 KiB, 12.3 MiB, 4.00 GiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}" if n >= 100 else f"{n:.2f} {unit}" if n < 10 else f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    """Left/right-aligned columns separated by two spaces, with a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, row in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out.append("  ".join(cells).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def render_table(est: Estimate) -> str:
    """Plain-text report: one row per line (item, bytes, tier, formula), then totals per
    tier per rank and per node, then the notes."""
    lay = est.layout
    head = (f"model: {est.parameters:,} parameters | dp={lay.dp}{' cp=' + str(lay.cp) if lay.cp > 1 else ''} tp={lay.tp} pp={lay.pp} "
            f"stage={lay.stage} precision={lay.precision} bsz={lay.micro_batch} "
            f"ci={lay.checkpoint_interval} tile={lay.tile_factor} accounting={lay.accounting}")
    rows = [["item", "bytes", "tier", "formula"]]
    rows += [[l.name, human_bytes(l.bytes), l.tier, l.formula] for l in est.lines]
    lines = [head, ""] + _table(rows, right={1}) + [""]
    per_rank, per_node = est.by_tier(), est.per_node()
    totals = [["tier", "per rank", f"per node ({lay.node_ranks} ranks)"]]
    totals += [[t, human_bytes(per_rank[t]), human_bytes(per_node[t])] for t in TIERS]
    totals.append(["total", human_bytes(sum(per_rank.values())), human_bytes(sum(per_node.values()))])
    lines += _table(totals, right={1, 2})
    if est.peak_at:
        lines.append(f"peak at: {est.peak_at} (engine accounting: the transient lines are what is live there)")
    if est.build is not None:
        b, n = est.build, lay.node_ranks
        how = ("under partitioned_init (one module whole at a time, fp32 shards)" if b.partitioned
               else "whole in fp32 on every rank")
        dev = f" + {human_bytes(b.device)} device" if b.device else ""
        lines.append(f"build peak (model built {how}, then wrapped): {human_bytes(b.host)} host RAM{dev} per rank, "
                     f"{human_bytes(b.host * n)} per node ({n} ranks), at {b.where}")
    lines += [f"note: {n}" for n in est.notes]
    return "\n".join(lines) + "\n"


def to_json(est: Estimate, indent: int | None = 2) -> str:
    """JSON of :meth:`Estimate.to_dict` (bytes as integers)."""
    data: dict[str, Any] = est.to_dict()
    return json.dumps(data, indent=indent, ensure_ascii=False)
