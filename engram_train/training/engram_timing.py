"""Per-step Engram timings for the log: hashing, lookups, and the part the step waited for.

- ``engram_hash_s``: CPU time spent hashing micro-batches (on the data thread when prefetched);
- ``engram_lookup_s``: time in lookups on the critical path without prefetch: starting them
  (id routing, gathers) plus waiting for their rows;
- ``engram_wait_s``: what the step actually waited for: rows not yet arrived when a layer ran,
  plus hashes not yet done when the step asked for its micro-batches.
With prefetch on, ``1 - engram_wait_s / engram_lookup_s`` of a run with prefetch off is the
hidden fraction.
- ``engram_host_gather_s`` / ``engram_host_update_s`` (host-resident tables only): gathering
  rows on the host and their copies to the device, and the host optimizer step;
  ``engram_host_update_critical_s`` the part of that step the training thread waited for (all
  of it when synchronous; launching it and waiting for shared rows when overlapped,
  ``training/host_update.py``).
"""

from __future__ import annotations

from engram_train.engram.host_table import HOST_TABLE_TIMES
from engram_train.parallel.lookup import LOOKUP_TIMES


class EngramStepTimes:
    """Reads the lookup timers and a ``HashPrefetchIterator``'s counters per logging window."""

    def __init__(self, hash_iterator=None) -> None:
        self.hash_iterator = hash_iterator
        self._hash = self._hash_wait = 0.0
        LOOKUP_TIMES.reset()
        HOST_TABLE_TIMES.reset()

    def window(self, steps: int) -> dict[str, float]:
        """Per-step means since the previous call (``steps`` steps ran in between)."""
        steps = max(int(steps), 1)
        it = self.hash_iterator
        hash_s = getattr(it, "hash_s", 0.0) - self._hash
        hash_wait = getattr(it, "wait_s", 0.0) - self._hash_wait
        self._hash, self._hash_wait = getattr(it, "hash_s", 0.0), getattr(it, "wait_s", 0.0)
        if getattr(it, "prefetch", True) is False:
            hash_wait = hash_s  # inline hashing: all of it is on the critical path
        out = dict(
            engram_hash_s=hash_s / steps,
            engram_lookup_s=(LOOKUP_TIMES.issue_s + LOOKUP_TIMES.wait_s) / steps,
            engram_wait_s=(LOOKUP_TIMES.wait_s + hash_wait) / steps,
        )
        if HOST_TABLE_TIMES.rows:
            out["engram_host_gather_s"] = (HOST_TABLE_TIMES.gather_s
                                           + HOST_TABLE_TIMES.copy_s) / steps
            out["engram_host_update_s"] = HOST_TABLE_TIMES.update_s / steps
            out["engram_host_update_critical_s"] = HOST_TABLE_TIMES.wait_s / steps
        LOOKUP_TIMES.reset()
        HOST_TABLE_TIMES.reset()
        return out
