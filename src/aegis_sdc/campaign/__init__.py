"""Fault campaigns: what the sensors catch and what they miss, checked against the coverage they
claim (docs/campaigns.md)."""

from aegis_sdc.campaign.coverage import Claim, coverage_report
from aegis_sdc.campaign.ranks import RankCampaignConfig, RankCampaignResult, run_rank_campaign
from aegis_sdc.campaign.runner import CampaignConfig, CampaignResult, TrialResult, run_campaign
from aegis_sdc.campaign.trials import LOCATIONS, Trial

__all__ = [
    "LOCATIONS",
    "CampaignConfig",
    "CampaignResult",
    "Claim",
    "RankCampaignConfig",
    "RankCampaignResult",
    "Trial",
    "TrialResult",
    "coverage_report",
    "run_campaign",
    "run_rank_campaign",
]
