"""Orbax, imported without a side effect on the root logger (`ocp`, as the checkpoint modules
use it).

While Orbax is imported, absl's `vlog` runs, and absl's `log` calls `logging.basicConfig()`
whenever the root logger has no handler. That handler would turn a user's later
`logging.basicConfig(level=...)` into a silent no-op (it returns when the root logger has one),
so the handlers this import adds, and only those, are removed again. A root logger configured
before keeps its handlers (absl adds none then). Later absl messages, during a save, add one
only if the root logger still has none by then, as absl always does."""

from __future__ import annotations

import logging


def _import_orbax():
    before = list(logging.root.handlers)
    import orbax.checkpoint

    for handler in [h for h in logging.root.handlers if h not in before]:
        logging.root.removeHandler(handler)
    return orbax.checkpoint


ocp = _import_orbax()
