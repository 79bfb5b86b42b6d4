"""Peak memory of a run: the process's resident set sampled in a thread while the run goes on (Linux).

    with PeakRSS() as peak:
        run()
    peak.extra_bytes  # highest RSS seen during the run minus RSS at its start (None where /proc is missing)

The systems run one after another in one process, so this is what each run added on top of what the
process already held; memory that an earlier run freed and this one reuses is not counted again.
"""

from __future__ import annotations

import os
import threading


def resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class PeakRSS:
    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.start_bytes: int | None = None
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = resident_bytes()
            if now is not None and (self.peak_bytes is None or now > self.peak_bytes):
                self.peak_bytes = now

    def __enter__(self) -> PeakRSS:
        self.start_bytes = self.peak_bytes = resident_bytes()
        if self.start_bytes is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        now = resident_bytes()
        if now is not None and self.peak_bytes is not None:
            self.peak_bytes = max(self.peak_bytes, now)

    @property
    def extra_bytes(self) -> int | None:
        if self.start_bytes is None or self.peak_bytes is None:
            return None
        return self.peak_bytes - self.start_bytes
