"""Every protected site in one numbering, identical on every rank.

The GEMM sites of the protected Linears come first, in module order, three per Linear (forward,
dgrad, wgrad: Linear i owns ids 3i, 3i+1, 3i+2, which is how the step plan indexes them); then
attention, fingerprint and collective sites in the order of their first use (ranks run the same
model and the same collectives, so they number them alike). The store learns each site once.
"""

from __future__ import annotations

from aegis_sdc.events import Site
from aegis_sdc.sensors.gemm import GemmSensor


class SiteRegistry:
    def __init__(self) -> None:
        self.gemm: list[GemmSensor] = []  # indexed by site id
        self.extra: list[Site] = []
        self._unwritten: list[Site] = []

    def next_gemm_site(self, module: str, kind) -> Site:
        """The site the next GEMM sensor gets (register the sensor with `add_gemm`)."""
        return Site(len(self.gemm), module, kind)

    def add_gemm(self, sensor: GemmSensor) -> None:
        if sensor.site.id != len(self.gemm) or self.extra:
            raise RuntimeError("GEMM sites are numbered first and in order")
        self.gemm.append(sensor)
        self._unwritten.append(sensor.site)

    def add(self, module: str, kind, op: str) -> Site:
        """A new attention, fingerprint or collective site, numbered after every GEMM site."""
        site = Site(len(self.gemm) + len(self.extra), module, kind, op=op)
        self.extra.append(site)
        self._unwritten.append(site)
        return site

    def id_of(self, name: str) -> int:
        for site in self.extra:
            if site.name == name:
                return site.id
        for sensor in self.gemm:
            if sensor.site.name == name:
                return sensor.site.id
        raise KeyError(f"no protected site named {name!r}")

    def take_unwritten(self) -> list[Site]:
        """Sites the store has not seen yet."""
        sites, self._unwritten = self._unwritten, []
        return sites
