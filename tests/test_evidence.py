"""Evidence files of confirmed incidents and `aegis replay` (docs/response.md)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file
from tests.helpers import guard_config, small_workload, train
from typer.testing import CliRunner

import aegis_sdc as aegis
from aegis_sdc.cli import app
from aegis_sdc.events import CommKind, Site, WrongExecution
from aegis_sdc.response.evidence import EvidenceError, load_evidence, write_incident_evidence
from aegis_sdc.response.replay import EXIT_OTHER, EXIT_RIGHT, EXIT_WRONG, OTHER, RIGHT, WRONG, replay_evidence
from aegis_sdc.verify.verifier import KeptReplay
from aegis_sdc.workloads.llama import LlamaConfig

# Three faults at step 20 of one run: a wgrad (a tile capture, column checks), a forward whose row
# capture spans both column tiles of its 256 outputs (the element sits in the second), and a
# persistent fault every replay reproduces (the verdict knows no right values).
WGRAD = aegis.FaultSpec(site="layers.0.attn.wo:wgrad", model="bitflip", bit=29, steps=(20,), seed=2)
FWD = aegis.FaultSpec(site="layers.0.mlp.up_proj:fwd", model="bitflip", bit=29, steps=(20,), row=70, col=200)
PERSISTENT = aegis.FaultSpec(site="layers.0.attn.wq:fwd", model="bitflip", bit=30, steps=(20,), affects_replay=True)
SPECS = {spec.site: spec for spec in (WGRAD, FWD, PERSISTENT)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evidence")
    model, data, optimizer = small_workload()
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp, faults=tuple(SPECS.values())))
    try:
        train(model, data, optimizer, 21)
    finally:
        guard.close()
    return guard, {i.site.name: i for i in guard.incidents}


def _evidence(guard, incident):
    return guard.run_dir / "evidence" / f"incident-{incident.identity.rank}-{incident.id}.json"


def test_each_confirmed_incident_writes_a_safetensors_and_json_pair(run):
    guard, incidents = run
    assert set(incidents) == set(SPECS)
    names = sorted(p.name for p in (guard.run_dir / "evidence").iterdir())
    assert names == sorted(f"incident-0-{i.id}.{ext}" for i in incidents.values() for ext in ("json", "safetensors"))
    for site, incident in incidents.items():
        path = _evidence(guard, incident)
        meta = json.loads(path.read_text())  # plain JSON and safetensors: nothing here unpickles
        tensor_path = path.with_name(meta["tensors"]["file"])
        data = tensor_path.read_bytes()
        assert not data.startswith(b"\x80") and hashlib.sha256(data).hexdigest() == meta["tensors"]["sha256"]
        tensors = load_file(tensor_path)
        assert meta["replayable"] and (meta["site"], meta["step"], meta["rank"]) == (site, 20, 0)
        assert meta["incident"]["evidence"]["threshold"] == incident.evidence.threshold
        gemm = meta["gemm"]
        assert gemm["path"] == "gemm-reference" and gemm["extent"] == "tile"
        assert gemm["tiling"] == {"rows": 128, "cols": 128}
        # one tile: A's row block [R, K] and B's column block [K, C], the tile's values
        tile = gemm["region"]
        rows, cols = tile["row_stop"] - tile["row_start"], tile["col_stop"] - tile["col_start"]
        k = gemm["shape"]["k"]
        assert tensors["a"].shape == (rows, k) and tensors["b"].shape == (k, cols)
        assert tensors["wrong.out"].shape == (rows, cols)
        row, col = guard_fault(guard, site).element(gemm["shape"]["m"], gemm["shape"]["n"])
        assert tile["row_start"] <= row < tile["row_stop"] and tile["col_start"] <= col < tile["col_stop"]
        if site == PERSISTENT.site:  # every execution computed the same wrong values
            assert gemm["values"]["right"] is None and "right.out" not in tensors
        else:  # the training step was wrong at the fault's element, the verifier's replays right
            assert gemm["values"]["wrong_execution"] == WrongExecution.ORIGINAL.value
            differs = tensors["wrong.out"] != tensors["right.out"]
            assert differs.nonzero().tolist() == [[row - tile["row_start"], col - tile["col_start"]]]
    assert incidents[FWD.site].evidence.tile.col_stop - incidents[FWD.site].evidence.tile.col_start == 256
    assert guard.verifier.kept == {}  # nothing kept past the step that wrote it


def guard_fault(guard, site):
    (injection,) = [j for j in guard.injector.log if j.site == site]
    return injection.fault


@pytest.mark.parametrize("site", sorted(SPECS))
def test_replay_on_a_healthy_device_computes_the_right_values(run, site):
    guard, incidents = run
    result = CliRunner().invoke(app, ["replay", str(_evidence(guard, incidents[site])), "--times", "2", "--json"])
    assert result.exit_code == EXIT_RIGHT, result.output
    report = json.loads(result.output)
    assert report["runs"] == [RIGHT, RIGHT] and report["outcome"] == "healthy"
    assert report["right_by"] == ("bound" if site == PERSISTENT.site else "bits")


@pytest.mark.parametrize("site", sorted(SPECS))
def test_replay_with_the_fault_injected_reproduces_the_wrong_values(run, site):
    guard, incidents = run
    path = _evidence(guard, incidents[site])
    report = replay_evidence(path, "cpu", times=2, fault=SPECS[site])  # resolved as the injector drew it
    assert report.runs == [WRONG, WRONG] and report.exit_code == EXIT_WRONG
    assert replay_evidence(path, "cpu", times=1, fault=guard_fault(guard, site)).runs == [WRONG]
    spec = SPECS[site]
    text = f"{spec.site}@model=bitflip,bit={spec.bit},steps=20,seed={spec.seed}"
    text += f",row={spec.row},col={spec.col}" if spec.row is not None else ""
    result = CliRunner().invoke(app, ["replay", str(path), "--times", "1", "--inject", text])
    assert result.exit_code == EXIT_WRONG and "WRONG" in result.output and "faulty" in result.output


def test_a_different_corruption_is_something_else(run):
    guard, incidents = run
    other = dataclasses.replace(WGRAD, bit=22)  # the same element, another bit
    report = replay_evidence(_evidence(guard, incidents[WGRAD.site]), "cpu", times=2, fault=other)
    assert report.runs == [OTHER, OTHER] and report.exit_code == EXIT_OTHER


def _bad(tmp_path, guard, incident, damage) -> CliRunner:
    src = _evidence(guard, incident)
    for path in (src, src.with_suffix(".safetensors")):
        shutil.copy(path, tmp_path / path.name)
    damage(tmp_path / src.name, tmp_path / src.with_suffix(".safetensors").name)
    return CliRunner().invoke(app, ["replay", str(tmp_path / src.name)])


def _truncate(meta, tensors):
    tensors.write_bytes(tensors.read_bytes()[:-100])


def _flip_a_value(meta, tensors):
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor: still a valid safetensors file
    tensors.write_bytes(bytes(data))


def _rehash_a_foreign_file(meta, tensors):
    from safetensors.torch import save

    data = save({"a": torch.zeros(2)})  # a valid file whose sha256 the JSON then names: not evidence
    tensors.write_bytes(data)
    doc = json.loads(meta.read_text())
    doc["tensors"]["sha256"] = hashlib.sha256(data).hexdigest()
    meta.write_text(json.dumps(doc))


def _truncate_json(meta, tensors):
    meta.write_bytes(meta.read_bytes()[:50])


def _foreign_json(meta, tensors):
    meta.write_text('{"hello": "world"}')


def _pickle_in_place(meta, tensors):
    torch.save({"a": torch.zeros(2)}, tensors)  # a pickle is never loaded


@pytest.mark.parametrize("damage", [_truncate, _flip_a_value, _rehash_a_foreign_file, _truncate_json, _foreign_json,
                                    _pickle_in_place])  # fmt: skip
def test_a_damaged_or_foreign_file_is_refused_in_one_line(run, tmp_path, damage):
    guard, incidents = run
    result = _bad(tmp_path, guard, incidents[WGRAD.site], damage)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_a_missing_file_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["replay", str(tmp_path / "incident-0-1.json")])
    assert result.exit_code == 2 and result.output.startswith("error: ")


def test_an_incident_of_another_kind_writes_its_metadata_as_not_replayable(run, tmp_path):
    _, incidents = run
    site = Site(99, "ddp.bucket0", CommKind.ALLREDUCE, "comm")
    incident = dataclasses.replace(incidents[WGRAD.site], site=site)
    path = write_incident_evidence(tmp_path, incident, KeptReplay(object(), ()))
    assert [p.name for p in (tmp_path / "evidence").iterdir()] == [path.name]
    meta = json.loads(path.read_text())
    assert meta["replayable"] is False and "collective" in meta["reason"] and meta["tensors"] is None
    assert load_evidence(path).tensors == {}
    with pytest.raises(EvidenceError, match="not replayable"):
        replay_evidence(path)
    assert CliRunner().invoke(app, ["replay", str(path)]).exit_code == 2


def test_a_failed_write_is_logged_and_never_raises(run, tmp_path, caplog):
    _, incidents = run
    (tmp_path / "evidence").write_text("a file where the directory goes")
    with caplog.at_level(logging.ERROR, logger="aegis_sdc"):
        assert write_incident_evidence(tmp_path, incidents[WGRAD.site], None) is None
    assert "could not be written" in caplog.text


def test_the_evidence_is_on_disk_when_a_raise_policy_stops_training(tmp_path):
    model, data, optimizer = small_workload()
    config = guard_config(tmp_path, faults=(WGRAD,), response=aegis.ResponseConfig(policy="raise"))
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    try:
        with pytest.raises(aegis.SilentDataCorruptionError) as raised:
            train(model, data, optimizer, 21)
    finally:
        guard.close()
    path = _evidence(guard, raised.value.incident)
    assert replay_evidence(path, times=1).runs == [RIGHT]


# -- the Triton kernel ---------------------------------------------------------------------------------


def _triton_flow(tmp_path, device: str, dtype: torch.dtype, cfg: LlamaConfig, batch: int, seq: int, bit: int):
    """A fault in each GEMM of one Linear on the Triton path; each incident's evidence replays right on
    the device, and wrong with the fault injected. The element's column lies past the first column tile."""
    from tests.test_triton_linear import config, tiny_workload

    spec = aegis.FaultSpec(site="layers.0.mlp.up_proj:*", model="bitflip", bit=bit, steps=(5,), row=20, col=700)
    model, data, optimizer = tiny_workload(cfg=cfg, batch=batch, seq=seq, dtype=dtype)
    guard = aegis.protect(model, optimizer=optimizer, config=config(tmp_path, faults=(spec,)))
    try:
        train(model, data, optimizer, 6)
    finally:
        guard.close()
    assert sorted(i.site.name for i in guard.incidents) == [f"layers.0.mlp.up_proj:{k}" for k in ("dgrad", "fwd",
                                                                                                  "wgrad")]  # fmt: skip
    extents = set()
    for incident in guard.incidents:
        path = _evidence(guard, incident)
        meta = json.loads(path.read_text())
        gemm = meta["gemm"]
        assert gemm["path"] == "gemm-triton" and gemm["extent"] == "tile"  # a row capture cropped to its tile
        extents.add((incident.site.kind.value, gemm["column_checks"], gemm["col_block"]))
        assert replay_evidence(path, device, times=2).runs == [RIGHT, RIGHT]
        report = replay_evidence(path, device, times=2, fault=spec)
        assert report.runs == [WRONG, WRONG] and report.exit_code == EXIT_WRONG
    return extents


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's test (the GPU runs the gpu-marked one)")
def test_triton_evidence_replays_under_the_interpreter(tmp_path):
    cfg = LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=128, max_seq_len=16)
    extents = _triton_flow(tmp_path, "cpu", torch.float32, cfg, batch=2, seq=16, bit=27)
    # 32×32 tiles: the forward's element (column 127 of 128) sits in column tile 3; wgrad checks columns
    assert ("fwd", False, 3) in extents and any(kind == "wgrad" and cols for kind, cols, _ in extents)


@pytest.mark.gpu
def test_gpu_triton_evidence_replays_on_cuda(tmp_path):
    cfg = LlamaConfig(vocab_size=256, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=1024, max_seq_len=128)
    extents = _triton_flow(tmp_path, "cuda:0", torch.bfloat16, cfg, batch=4, seq=128, bit=26)
    # 256-column tiles on the GPU's short-k class: the forward's element (column 700) is in tile 2
    assert ("fwd", False, 2) in extents
