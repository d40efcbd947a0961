"""What both weight-sync modes share: the samplers in service, those taken out of service, the
version each holds, and concurrent HTTP calls to them."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Sequence

from loguru import logger

from t1async.sampling.sampler_client import SamplerError, post_json
from t1async.weights.protocol import PAUSE_MODES, WeightSyncError


class SamplerSet:
    """What both modes share: the samplers in service, those taken out of service, the version
    each holds, and concurrent HTTP calls to them (see :class:`DistributedWeightSync` for the
    attributes).

    Raises:
        WeightSyncError: a pause mode other than those of :data:`PAUSE_MODES`.
    """

    def _out_of_service(self, version: int, bad: list[str]) -> None:
        """Log and raise :class:`WeightSyncError` for the samplers ``bad`` that failed ``version``
        (already in ``self.failed``): out of service, left paused."""
        logger.error("weight version {}: samplers taken out of service (left paused): {}", version,
                     {u: self.failed[u] for u in bad})
        raise WeightSyncError(f"weight version {version} failed on {len(bad)} sampler(s), now out of service "
                              f"(paused, never serving partial weights): {[f'{u}: {self.failed[u]}' for u in bad]}")

    def __init__(self, timeout_s: float, *, bucket_mb: float, pause_mode: str,
                 tp_sizes: Sequence[int] | None = None) -> None:
        if pause_mode not in PAUSE_MODES:
            raise WeightSyncError(f"weight_sync.pause_mode {pause_mode!r} is not supported: use one of {PAUSE_MODES} "
                                  "(the pinned SGLang reports no per-token weight versions)")
        self.timeout_s, self.pause_mode = timeout_s, pause_mode
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.tp_sizes = list(tp_sizes) if tp_sizes is not None else None
        self.urls: list[str] = []
        self.failed: dict[str, str] = {}
        self.held: dict[str, int] = {}  # sampler -> weight version it took from this learner
        self.last_pause_s = 0.0
        self.last_form_s = 0.0
        self._want: list[str] | None = None  # membership asked for by set_members (None: those connected)
        self._members_lock = threading.Lock()
        self._connected = False
        self._pool: ThreadPoolExecutor | None = None

    # ---- live membership (t1async scale sampler.num_samplers, a restarted sampler) ----------
    def set_members(self, urls: list[str]) -> None:
        """The samplers to publish to from now on (thread-safe; the launch's sampler pool calls it
        through the learner). Departed ones leave at the next publish, which re-forms the group
        *before* pausing anyone (the others keep serving during the rendezvous) and never waits
        for them; new ones get weights from :meth:`load` or that publish."""
        with self._members_lock:
            self._want = list(urls)

    def members(self) -> list[str]:
        """Samplers in service to publish to: the last :meth:`set_members` (else those connected)
        less those taken out of service. Forgets failures and versions of departed samplers."""
        with self._members_lock:
            want = list(self._want) if self._want is not None else list(self.urls)
        for d in (self.failed, self.held):
            for u in [u for u in d if u not in want]:
                del d[u]
        return [u for u in want if u not in self.failed]

    def snapshot(self) -> dict[str, Any]:
        """``{"members", "failed", "held"}`` copied for another thread (the learner's status)."""
        for _ in range(5):
            try:
                return {"members": list(self.urls), "failed": dict(self.failed), "held": dict(self.held)}
            except RuntimeError:  # changed size while copied by a publish in the learner's thread
                time.sleep(0.01)
        return {"members": list(self.urls), "failed": {}, "held": {}}

    def joiners(self) -> list[str]:
        """Members that hold no weights from this learner yet (new or restarted samplers)."""
        return [u for u in self.members() if u not in self.held]

    def _ensure_pool(self, n: int) -> None:
        """Worker threads for ``n`` samplers (one blocked call per member, twice over)."""
        if self._pool is None or self._pool._max_workers < 2 * n:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(max_workers=max(8, 2 * n), thread_name_prefix="weight-sync")

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _all(self, path: str, body: dict, urls: list[str]) -> dict[str, str]:
        """POST ``body`` to every url at once; ``{url: error}`` of those that failed."""
        assert self._pool is not None
        futures = {u: self._pool.submit(post_json, u, path, body, timeout_s=self.timeout_s) for u in urls}
        errors = {}
        for u, f in futures.items():
            try:
                res = f.result(timeout=self.timeout_s + 5)
                if isinstance(res, dict) and res.get("success") is False:
                    errors[u] = str(res.get("message"))
            except (SamplerError, FutureTimeout) as e:
                errors[u] = str(e) or type(e).__name__
        return errors


def collect_answers(futures: dict[str, Any], bucket: int, timeout_s: float, errors: dict[str, str]) -> None:
    """Wait for each sampler's answer to the update of ``bucket`` (futures of
    :func:`~t1async.sampling.sampler_client.post_json`, keyed by URL) and record in ``errors`` every sampler
    that answered ``success: false``, failed or did not answer within ``timeout_s`` (+5 s)."""
    for u, f in futures.items():
        try:
            res = f.result(timeout=timeout_s + 5)
            if not res.get("success", False):
                errors[u] = f"bucket {bucket}: {res.get('message')}"
        except (SamplerError, FutureTimeout) as e:
            errors[u] = f"bucket {bucket}: {e or type(e).__name__}"
