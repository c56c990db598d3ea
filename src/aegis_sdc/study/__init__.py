"""The paired healthy-vs-suspect study: what a corruption does to training (docs/study.md)."""

from aegis_sdc.study.config import MODES, StudyConfig
from aegis_sdc.study.harness import StudyResult, run_study
from aegis_sdc.study.modes import NondeterminismError

__all__ = ["MODES", "NondeterminismError", "StudyConfig", "StudyResult", "run_study"]
