"""`aegis screen`: a device's verdict from synthetic sweeps, a reference and evidence replays (docs/response.md).

On the CPU the sweeps run the reference path at small shapes (fp32); the Triton kernel runs under the
interpreter in fp16 at one tiny shape, and in bf16 at real shapes on a GPU (marked `gpu`).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from tests.helpers import guard_config, small_workload, train
from typer.testing import CliRunner

import aegis_sdc as aegis
from aegis_sdc.cli import app
from aegis_sdc.faults.models import FaultSpec
from aegis_sdc.response import screen as sc
from aegis_sdc.response.evidence import load_evidence

SHAPES = ["--device", "cpu", "--shapes", "64x48,48x96", "--tokens", "64"]  # 2 Linears × 3 GEMMs × 3 scales


def invoke(*args: str):
    return CliRunner().invoke(app, ["screen", *args])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("screen") / "ref.json"
    result = invoke(*SHAPES, "--record", str(path), "--json")
    assert result.exit_code == sc.EXIT_PASS, result.output
    return path


def test_the_model_tables_hold_the_linears_of_the_models():
    tiny = sc.parse_shapes("tinyllama")
    assert tiny == {"q_o": (2048, 2048), "k_v": (2048, 256), "gate_up": (2048, 5632), "down": (5632, 2048),
                    "lm_head": (2048, 32000)}  # fmt: skip
    cases = sc.make_cases(tiny, 2048, sc.DEFAULT_SCALES)
    assert len(cases) == 5 * 3 * 3 and len({c.name for c in cases}) == len(cases)
    by_name = {c.name: c for c in cases}
    # (M, K, N) of C = A·B: the forward, dgrad and wgrad of the key/value projection
    assert by_name["k_v:fwd@scale=0.001"].shape == (2048, 2048, 256)
    assert by_name["k_v:dgrad@scale=1"].shape == (2048, 256, 2048)
    assert by_name["k_v:wgrad@scale=1000"].shape == (256, 2048, 2048)
    assert sc.parse_shapes("64x48, 48X96") == {"64x48": (64, 48), "48x96": (48, 96)}


def test_record_then_against_passes_bit_for_bit(reference):
    doc = json.loads(reference.read_text())
    assert doc["format"] == sc.FORMAT and len(doc["cases"]) == 18
    assert doc["env"]["path"] == sc.REFERENCE and doc["env"]["dtype"] == "float32"
    result = invoke("--device", "cpu", "--against", str(reference), "--json")
    assert result.exit_code == sc.EXIT_PASS, result.output
    report = json.loads(result.output)
    assert report["verdict"] == sc.PASS and report["failing"] == []
    assert report["reference"]["compared"] and report["reference"]["differs"] == []
    assert [c["reference"] for c in report["cases"]] == ["same"] * 18
    assert all(not c["alarm"] and c["runs_agree"] and c["row"] < c["row_bound"] for c in report["cases"])


def test_a_gross_bitflip_fails_on_the_checksum_alone():
    # bit 30 of an accumulator value below 2 multiplies it by 2¹²⁸: beyond the exact bound
    result = invoke(*SHAPES, "--inject", "64x48:fwd@model=bitflip,bit=30,steps=0", "--json")
    assert result.exit_code == sc.EXIT_FAIL, result.output
    report = json.loads(result.output)
    assert report["verdict"] == sc.FAIL and report["reference"] is None
    assert [f["case"] for f in report["failing"]] == ["64x48:fwd@scale=0.001"]  # steps=0: the first scale
    assert report["failing"][0]["reason"].startswith("checksum: row")
    assert [c["name"] for c in report["cases"] if c["faulted"]] == ["64x48:fwd@scale=0.001"]


def test_a_bitflip_the_checksum_cannot_see_fails_against_the_reference(reference):
    # a mantissa bit: far below the exact bound, but a different output
    fault = "48x96:wgrad@model=bitflip,bit=3,probability=1"
    result = invoke("--device", "cpu", "--against", str(reference), "--inject", fault)
    assert result.exit_code == sc.EXIT_FAIL, result.output
    wgrads = [f"48x96:wgrad@scale={s}" for s in ("0.001", "1", "1000")]
    for name in wgrads:
        assert f"{name}: differs from the reference bit for bit" in result.output
    assert result.output.count("differs from the reference") == 3 and "checksum:" not in result.output
    assert result.output.rstrip().endswith("FAIL")
    without = invoke(*SHAPES, "--inject", fault)  # no reference: the checksums alone pass it
    assert without.exit_code == sc.EXIT_PASS, without.output


def _resigned(doc: dict) -> str:
    doc["sha256"] = sc._digest(doc)
    return json.dumps(doc)


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text.replace('"out": "', '"out": "0', 1),  # a fingerprint changed
        lambda text: text[: len(text) // 2],  # truncated
        lambda text: '{"format": "aegis-sdc-evidence", "version": 1}',  # another aegis file
        lambda text: "[1, 2, 3]",
        lambda text: _resigned({**json.loads(text), "version": 7}),
        lambda text: _resigned({**json.loads(text), "cases": json.loads(text)["cases"][:-1]}),  # a case missing
    ],
    ids=["modified", "truncated", "evidence", "not-an-object", "version", "cases"],
)
def test_a_tampered_or_foreign_reference_is_refused_in_one_line(reference, tmp_path, damage):
    bad = tmp_path / "bad.json"
    bad.write_text(damage(reference.read_text()))
    result = invoke("--device", "cpu", "--against", str(bad))
    assert result.exit_code == sc.EXIT_ERROR, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    "args",
    [
        ["--device", "cpu", "--against", "missing.json"],
        ["--device", "cpu", "--record", "a.json", "--against", "b.json"],
        [*SHAPES, "--scales", "1,-2"],
        [*SHAPES, "--evidence", "no-such-run"],
        ["--device", "tpu", "--shapes", "64x48"],
        ["--device", "cpu", "--shapes", "sixtyfour"],
    ],
)
def test_usage_and_file_errors_exit_2_in_one_line(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(*args)
    assert result.exit_code == sc.EXIT_ERROR, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output


def test_the_reference_fixes_the_cases(reference):
    result = invoke("--device", "cpu", "--against", str(reference), "--scales", "1")
    assert result.exit_code == sc.EXIT_ERROR and "the reference fixes the cases" in result.output


def test_a_reference_from_another_kind_of_device_is_inconclusive(reference, tmp_path):
    doc = json.loads(reference.read_text())
    doc["env"]["device"] = "NVIDIA H200 sm_90"
    other = tmp_path / "other.json"
    other.write_text(_resigned(doc))
    result = invoke("--device", "cpu", "--against", str(other), "--json")
    assert result.exit_code == sc.EXIT_INCONCLUSIVE, result.output
    report = json.loads(result.output)
    assert report["verdict"] == sc.INCONCLUSIVE and report["reference"]["kind_differs"] == ["device"]
    assert "bits not compared" in report["notes"][0] and all(c["reference"] is None for c in report["cases"])
    # what the checksums see still fails the device
    gross = invoke("--device", "cpu", "--against", str(other), "--inject", "64x48:dgrad@model=bitflip,bit=30,steps=0")
    assert gross.exit_code == sc.EXIT_FAIL and "64x48:dgrad@scale=0.001: checksum" in gross.output


def test_two_runs_that_differ_fail_the_device(monkeypatch):
    # A device whose arithmetic is not repeatable: every second GEMM gets one mantissa bit flipped.
    real = sc.checked_gemm
    calls = []

    def flaky(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(1)
        if len(calls) % 2 == 0:
            result.out.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
        return result

    monkeypatch.setattr(sc, "checked_gemm", flaky)
    report = sc.screen("cpu", shapes="64x48", tokens=64, scales=(1.0,))
    assert report.verdict == sc.FAIL and report.exit_code == sc.EXIT_FAIL
    assert {f["reason"] for f in report.failing()} == {"two runs on the same inputs computed different bits"}
    assert len(report.failing()) == 3


# -- evidence replays ------------------------------------------------------------------------------

FAULT = aegis.FaultSpec(site="layers.0.mlp.up_proj:fwd", model="bitflip", bit=29, steps=(3,), row=70, col=200)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run whose step 3 was corrupted: one confirmed incident, its evidence on disk."""
    model, data, optimizer = small_workload()
    config = guard_config(tmp_path_factory.mktemp("screen-run"), faults=(FAULT,))
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", aegis.SilentDataCorruptionWarning)
            train(model, data, optimizer, 4)
    finally:
        guard.close()
    assert [(i.site.name, i.step) for i in guard.incidents] == [(FAULT.site, 3)]
    return guard.run_dir


def test_evidence_replayed_on_a_healthy_device_is_counted_right(run_dir, reference):
    result = invoke("--device", "cpu", "--against", str(reference), "--evidence", str(run_dir), "--json")
    assert result.exit_code == sc.EXIT_PASS, result.output
    report = json.loads(result.output)
    assert report["evidence_counts"] == {"right": 1, "wrong": 0, "other": 0, "skipped": 0}
    (entry,) = report["evidence"]
    assert entry["site"] == FAULT.site and entry["runs"] == ["right"] * sc.REPLAY_TIMES


def test_evidence_reproduced_by_a_faulty_device_fails_it(run_dir):
    spec = f"{FAULT.site}@model=bitflip,bit=29,steps=3,row=70,col=200"
    result = invoke(*SHAPES, "--evidence", str(run_dir / "evidence"), "--inject", spec, "--json")
    assert result.exit_code == sc.EXIT_FAIL, result.output
    report = json.loads(result.output)
    assert report["evidence_counts"]["wrong"] == 1
    assert [f["reason"] for f in report["failing"]] == [f"replay reproduced the wrong values ({FAULT.site})"]
    assert not any(c["faulted"] for c in report["cases"])  # the spec names no synthetic case
    other = FaultSpec.parse(f"{FAULT.site}@model=bitflip,bit=22,steps=3,row=70,col=200")  # another corruption
    report = sc.screen("cpu", shapes="64x48", tokens=64, scales=(1.0,), evidence=[run_dir], fault=other)
    assert report.evidence_counts()["other"] == 1 and report.verdict == sc.INCONCLUSIVE


def test_an_unusable_evidence_file_exits_2(run_dir, tmp_path):
    (json_file,) = (run_dir / "evidence").glob("*.json")
    bad = tmp_path / json_file.name
    bad.write_text(json_file.read_text()[:40])
    result = invoke(*SHAPES, "--evidence", str(bad))
    assert result.exit_code == sc.EXIT_ERROR and result.output.startswith("error: "), result.output


# -- the Triton kernel -----------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's test (the GPU runs the gpu-marked one)")
# the fault's ×2¹²⁸ value overflows the interpreter's numpy casts, as in tests/test_triton_gemm.py
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_the_triton_kernel_screens_under_the_interpreter():
    # fp16: the interpreter computes bf16 arithmetic wrongly (tests/test_triton_gemm.py)
    kwargs = dict(shapes="32x64", tokens=32, scales=(1.0,), path=sc.TRITON, dtype=torch.float16)
    healthy = sc.screen("cpu", **kwargs)
    assert healthy.verdict == sc.PASS and healthy.env["kernel"]["configs"].keys() == {"interpreter"}
    assert all(c.runs_agree and c.row < c.row_bound for c in healthy.cases)
    assert healthy.cases[2].col is not None  # wgrad: the column check
    again = sc.screen("cpu", against=json.loads(json.dumps(_reference_doc(healthy))), **_no_cases(kwargs))
    assert again.verdict == sc.PASS and again.reference["differs"] == []
    faulty = sc.screen("cpu", fault=FaultSpec.parse("32x64:wgrad@model=bitflip,bit=30,steps=0"), **kwargs)
    assert [f["case"] for f in faulty.failing()] == ["32x64:wgrad@scale=1"]


def _reference_doc(report: sc.ScreenReport) -> dict:
    return {"env": report.env, "params": report.params,
            "cases": [{"name": c.name, "out": c.out, "partials": c.partials} for c in report.cases]}  # fmt: skip


def _no_cases(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k in ("path", "dtype")}


@pytest.mark.gpu
def test_gpu_screen_records_passes_and_flags_a_faulty_kernel(tmp_path):
    # Real shapes of two classes (narrow N: a GQA key/value projection; square) at 512 tokens, bf16.
    kwargs = dict(shapes="2048x256,2048x2048", tokens=512)
    healthy = sc.screen("cuda", **kwargs)
    assert healthy.verdict == sc.PASS, healthy.failing()
    assert healthy.env["path"] == sc.TRITON and healthy.env["dtype"] == "bfloat16"
    reference = sc.load_reference(sc.write_reference(healthy, tmp_path / "ref.json"))
    again = sc.screen("cuda", against=reference)
    assert again.verdict == sc.PASS and again.reference["compared"] and again.reference["differs"] == []
    # bit 16: the top mantissa bit bf16 keeps, far below the exact bound
    low = sc.screen("cuda", against=reference, fault=FaultSpec.parse("2048x256:fwd@model=bitflip,bit=16,probability=1"))
    assert {f["case"] for f in low.failing()} == {f"2048x256:fwd@scale={s}" for s in ("0.001", "1", "1000")}
    gross = sc.screen("cuda", fault=FaultSpec.parse("2048x2048:wgrad@model=bitflip,bit=30,steps=0"), **kwargs)
    assert [(f["case"], f["reason"][:8]) for f in gross.failing()] == [("2048x2048:wgrad@scale=0.001", "checksum")]


# -- clean samples ---------------------------------------------------------------------------------

CLEAN_EVERY, CLEAN_MAX, CLEAN_STEPS = 3, 40, 8  # windows [3, 6) and [6, 9): two per site, capped at 40


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """A clean run with the clean samples' constants lowered: every 3 steps, at most 40."""
    from aegis_sdc.sensors import gemm

    model, data, optimizer = small_workload()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gemm, "CLEAN_SAMPLE_EVERY", CLEAN_EVERY)
        patch.setattr(gemm, "MAX_CLEAN_SAMPLES", CLEAN_MAX)
        guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path_factory.mktemp("clean-run")))
    try:
        train(model, data, optimizer, CLEAN_STEPS)
    finally:
        guard.close()
    assert not guard.incidents
    return guard


def _clean_files(run_dir) -> list:
    return sorted((run_dir / "evidence").glob("clean-*.json"))


def test_a_run_keeps_a_bounded_sample_of_clean_tiles(clean_run):
    files = _clean_files(clean_run.run_dir)
    metas = [json.loads(f.read_text()) for f in files]
    assert len(metas) == CLEAN_MAX and clean_run.clean_budget.written == CLEAN_MAX
    sites = {s.id for s in clean_run.sites if s.id < len(clean_run.sensors)}
    # one per site at the first checked step of each window (every call is checked on the CPU), none
    # in the first window, nothing on the other steps; the cap stops the second window part way
    assert {m["site_id"] for m in metas if m["step"] == 3} == sites and len(sites) < CLEAN_MAX
    assert {m["step"] for m in metas} == {3, 6}
    assert len({(m["site_id"], m["step"]) for m in metas}) == CLEAN_MAX
    for path, meta in zip(files, metas, strict=True):
        assert meta["clean"] is True and meta["incident"] is None and meta["replayable"]
        assert path.name == f"clean-0-{meta['site_id']}-{meta['step']}.json"
        assert (path.parent / meta["tensors"]["file"]).is_file()
        gemm = meta["gemm"]
        assert gemm["path"] == sc.REFERENCE and gemm["extent"] == "tile" and gemm["values"]["wrong"] is None
        assert meta["recorded_env"]["path"] == sc.REFERENCE and meta["recorded_env"]["device"].startswith("cpu")
    loaded = load_evidence(files[0])
    assert loaded.tensors and not any(name.startswith("wrong.") for name in loaded.tensors)


def test_a_healthy_device_reproduces_the_clean_samples(clean_run):
    from aegis_sdc.response.replay import EXIT_RIGHT, replay_evidence

    result = invoke(*SHAPES, "--evidence", str(clean_run.run_dir), "--json")
    assert result.exit_code == sc.EXIT_PASS, result.output
    report = json.loads(result.output)
    assert report["verdict"] == sc.PASS and report["failing"] == []
    assert report["clean_counts"] == {"right": CLEAN_MAX, "differs": 0, "uncompared": 0}
    assert report["evidence_counts"] == {"right": 0, "wrong": 0, "other": 0, "skipped": 0}
    assert all(e["clean"] and e["runs"] == ["right"] * sc.REPLAY_TIMES for e in report["evidence"])
    one = replay_evidence(_clean_files(clean_run.run_dir)[0], "cpu", 2)  # `aegis replay` reads them too
    assert one.exit_code == EXIT_RIGHT and one.clean and one.right_by == "bits"


def test_a_faulty_device_fails_on_a_clean_sample(clean_run):
    path = _clean_files(clean_run.run_dir)[0]
    meta = json.loads(path.read_text())
    region = meta["gemm"]["region"]
    row, col = region["row_start"] + 1, region["col_start"] + 2  # inside the stored tile
    spec = f"{meta['site']}@model=bitflip,bit=22,steps={meta['step']},row={row},col={col}"
    result = invoke(*SHAPES, "--evidence", str(clean_run.run_dir), "--inject", spec, "--json")
    assert result.exit_code == sc.EXIT_FAIL, result.output
    report = json.loads(result.output)
    failing = {f["evidence"]: f["reason"] for f in report["failing"]}
    reason = f"the clean sample of {meta['site']} at step {meta['step']} was not reproduced bit for bit"
    assert failing[str(path)] == reason
    # only the samples of the faulted site whose tile holds the element can fail
    entries = {e["evidence"]: e for e in report["evidence"]}
    assert all(entries[p]["site"] == meta["site"] and entries[p]["faulted"] for p in failing)
    assert report["clean_counts"]["differs"] == len(failing) and not any(c["faulted"] for c in report["cases"])


def _copy_evidence(run_dir, tmp_path):
    import shutil

    folder = tmp_path / "evidence"
    shutil.copytree(run_dir / "evidence", folder)
    return folder, sorted(folder.glob("clean-*.json"))[0]


def test_a_tampered_clean_sample_exits_2_or_fails(clean_run, tmp_path):
    import hashlib

    from safetensors.torch import load, save

    folder, path = _copy_evidence(clean_run.run_dir, tmp_path)
    meta = json.loads(path.read_text())
    tensor_file = folder / meta["tensors"]["file"]
    data = bytearray(tensor_file.read_bytes())
    data[-1] ^= 1  # a modified tensor file: its sha256 is not the one the JSON names
    tensor_file.write_bytes(bytes(data))
    result = invoke(*SHAPES, "--evidence", str(folder))
    assert result.exit_code == sc.EXIT_ERROR and result.output.startswith("error: "), result.output
    assert "sha256" in result.output and len(result.output.strip().splitlines()) == 1
    # a forged right value with a matching sha256: the file is usable, and the device does not reproduce it
    data[-1] ^= 1
    tensors = load(bytes(data))
    tensors["right.out"] = tensors["right.out"].clone()
    tensors["right.out"].view(-1)[0] += 1.0
    forged = save(tensors)
    tensor_file.write_bytes(forged)
    meta["tensors"]["sha256"] = hashlib.sha256(forged).hexdigest()
    path.write_text(json.dumps(meta))
    result = invoke(*SHAPES, "--evidence", str(folder), "--json")
    assert result.exit_code == sc.EXIT_FAIL, result.output
    assert [f["evidence"] for f in json.loads(result.output)["failing"]] == [str(path)]


def test_a_clean_sample_from_another_kind_of_device_is_inconclusive(clean_run, tmp_path):
    folder, path = _copy_evidence(clean_run.run_dir, tmp_path)
    meta = json.loads(path.read_text())
    meta["recorded_env"]["device"] = "NVIDIA H100 80GB HBM3 sm_90"
    path.write_text(json.dumps(meta))
    result = invoke(*SHAPES, "--evidence", str(folder), "--json")
    assert result.exit_code == sc.EXIT_INCONCLUSIVE, result.output
    report = json.loads(result.output)
    assert report["clean_counts"] == {"right": CLEAN_MAX - 1, "differs": 0, "uncompared": 1}
    assert any("another kind of device" in note and "device" in note for note in report["notes"])
