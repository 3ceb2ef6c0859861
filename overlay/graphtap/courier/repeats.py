"""The sink writer's check for positions written twice: vLLM recomputes a preempted
request, so a site may get a position again, later. Such requests are listed in the
sink's index (`repeated`): a reader keeps the last row of a position, as the
per-request path does."""
from __future__ import annotations

import numpy as np


class Repeats:
    """Per site and request index the last position written (-1: none yet), as one
    array checked a hand-over at a time (a dict looked up per request of every piece
    held the GIL the engine's thread needs)."""

    def __init__(self):
        self._through = np.full((0, 0), -1, np.int64)  # [site id, request]
        self._site_ids: dict[str, int] = {}
        self.requests: set[int] = set()  # requests with a position written twice

    def note(self, request: np.ndarray, position: np.ndarray, runs) -> None:
        """Rows labelled by request and position, in runs of (site, rows, ...): requests
        with a position at or before one already written at the same site go to
        `requests`; one pass over the hand-over."""
        sites = [self._site_ids.setdefault(site, len(self._site_ids)) for site, *_ in runs]
        site = np.repeat(np.asarray(sites, np.int64), [run[1] for run in runs])
        seen = self._through
        shape = (len(self._site_ids), int(request.max()) + 1)
        if seen.shape[0] < shape[0] or seen.shape[1] < shape[1]:
            grown = np.full((max(shape[0], 2 * seen.shape[0]),
                             max(shape[1], 2 * seen.shape[1])), -1, np.int64)
            grown[:seen.shape[0], :seen.shape[1]] = seen
            self._through = seen = grown
        key = site * seen.shape[1] + request
        order = np.argsort(key, kind="stable")  # a site's requests come in runs
        k, p = key[order], position[order]
        starts = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1])))
        ids = k[starts]
        flat = seen.reshape(-1)
        prev = flat[ids]
        again = ids[(prev >= 0) & (np.minimum.reduceat(p, starts) <= prev)]
        if len(again):
            self.requests.update((again % seen.shape[1]).tolist())
        flat[ids] = np.maximum(prev, np.maximum.reduceat(p, starts))
