"""Child process for the SIGKILL test: writes incidents forever, printing each id once committed."""

from __future__ import annotations

import sys

from aegis_sdc.events import (
    Channel,
    Evidence,
    GemmKind,
    Incident,
    RankIdentity,
    Site,
    Tile,
    Verdict,
    VerdictKind,
    VTask,
    WrongExecution,
)
from aegis_sdc.store.sqlite import Store


def main(path: str) -> None:
    store = Store(path)
    site = Site(0, "layers.0.mlp.up_proj", GemmKind.FORWARD)
    store.write_sites([site])
    who = RankIdentity(host="writer", rank=0)
    i = 0
    while True:
        i += 1
        evidence = Evidence(site, i, 0, Channel.ROW, 100.0 + i, 50.0, 3, 1e-3, Tile(0, 128, 0, 128), (Channel.ROW,))
        task = VTask(i, evidence, payload=None)
        verdict = Verdict(i, site, i, VerdictKind.CONFIRMED_SDC, WrongExecution.ORIGINAL, detail="x" * 2000)
        with store.transaction():
            store.write_vtask(task)
            store.write_verdict(verdict, i)
            store.write_incident(Incident(i, site, i, who, evidence, verdict))
        print(i, flush=True)  # only after COMMIT returned


if __name__ == "__main__":
    main(sys.argv[1])
