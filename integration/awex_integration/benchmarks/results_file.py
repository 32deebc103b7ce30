"""A benchmark's results file: what it measured, on which machine, when, and its rows (JSON)."""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path


def write(path: str, what: str, **rows) -> None:
    """Write ``{"what", "machine", "date", **rows}`` to ``path`` (the machine: its CPU cores and processor)."""
    doc = {
        "what": what,
        "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
        "date": datetime.now(timezone.utc).date().isoformat(),
        **rows,
    }
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
