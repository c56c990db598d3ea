"""Dependencies point downward only: kernels ← ops ← sensors ← verify ← response ← runtime ← guard (DESIGN.md)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "aegis_sdc"
# What each layer may import from the package (besides itself and the leaves).
LEAVES = {"events", "hashing", "bounded", "validation", "config", "faults", "store", "distributed"}
BASE_LEAVES = {"hashing", "events", "bounded", "validation"}  # what the lower layers may import
ALLOWED = {
    "kernels": set(),
    "ops": {"kernels"},
    "sensors": {"kernels", "ops"},
    "verify": {"kernels", "ops", "sensors"},
    "response": {"kernels", "ops", "sensors", "verify"},  # policies, evidence files, certificates
    "runtime": {"kernels", "ops", "sensors", "verify", "response"},
    "faults": {"hashing"},
    "store": set(),
    "distributed": {"events", "kernels"},  # the fused chunk sums of the collective checks
    "study": {"kernels", "workloads", "report"},  # the workload, the reference GEMM, plots from the store
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("aegis_sdc."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("aegis_sdc."):
                    found.add(alias.name.split(".")[1])
    return found


def test_layers_import_only_downward():
    problems = []
    for layer, allowed in ALLOWED.items():
        for path in (PACKAGE / layer).glob("*.py"):
            extra = (
                imports_of(path)
                - allowed
                - {layer}
                - (LEAVES if layer not in ("faults", "store", "distributed") else BASE_LEAVES)
            )
            if extra:
                problems.append(f"{path.relative_to(PACKAGE)} imports {sorted(extra)}")
    assert not problems, problems
