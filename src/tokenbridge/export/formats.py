"""The export formats by name, in the order ``run`` writes them.

A module of its own so a config schema (:mod:`tokenbridge.runconfig`) can name them
without loading the writers, which bring numpy and pyarrow: ``reconstruct`` and
``inspect`` check their flags against that schema and write no export.
"""

from __future__ import annotations

__all__ = ["FORMATS"]

#: One :class:`~tokenbridge.export.writers.Writer` each (``writers.WRITERS``, same order).
FORMATS: tuple[str, ...] = ("specforge", "speculators", "parquet", "conversations")
