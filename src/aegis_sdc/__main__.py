"""`python -m aegis_sdc` is the `aegis` command."""

from aegis_sdc.cli import app

app(prog_name="aegis")
