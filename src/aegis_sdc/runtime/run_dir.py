"""The run directory a guard writes to, and its rank's store, opened under the writer lock.

A `GuardConfig.run_dir` the user names is theirs: when another live guard already writes that
rank's store there, `protect()` fails with `StoreInUseError` naming the holder (two writers on one
store would collide on record ids). The default directory (``aegis-runs/<run id>``) is ours to
choose: a second guard of the same run id and rank — two models protected in one process, or two
jobs started in the same second from one directory — takes ``aegis-runs/<run id>-2`` (then ``-3``,
…) and says so in the log. Guards created in the same order on every rank get the same suffix on
every rank. A run id taken from the clock names one run: a directory where this rank's store
already exists belongs to an earlier guard (one closed a moment ago in the same second) and is
passed over too — its steps, incidents and quarantine list are not this run's. A run id from the
environment (AEGIS_RUN_ID, torchrun's) is the job's own: a restarted job resumes in its directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

from aegis_sdc.config import default_run_dir, run_id_from_environment
from aegis_sdc.store.sqlite import Store, StoreInUseError, rank_db_path

log = logging.getLogger("aegis_sdc")

MAX_SIBLINGS = 1000  # default directories tried before giving up (a leak of guards, surely)


def open_run_store(run_dir: str | None, rank: int) -> tuple[Path, Store]:
    """The run directory and this rank's store in it, locked for writing."""
    if run_dir is not None:
        return Path(run_dir), Store(rank_db_path(run_dir, rank), lock=True)
    base = default_run_dir()
    resumable = run_id_from_environment() is not None
    for n in range(1, MAX_SIBLINGS + 1):
        candidate = Path(base if n == 1 else f"{base}-{n}")
        if not resumable and rank_db_path(candidate, rank).exists():
            continue  # an earlier run's, started in the same second
        try:
            store = Store(rank_db_path(candidate, rank), lock=True)
        except StoreInUseError:
            continue
        if n > 1:
            log.info("aegis-sdc: %s is taken by another guard; this one writes to %s", base, candidate)
        return candidate, store
    raise StoreInUseError(f"{base} and its {MAX_SIBLINGS - 1} siblings are all taken by other guards")
