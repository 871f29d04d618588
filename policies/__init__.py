"""SLO-driven control of the FSD threshold T: contracts, policies, wrappers and the registry.

Pure Python (numpy, pydantic); no Ray, no torch, no clock reads — the same objects run in the simulator
and in the live controller.
"""

from policies.bandit import BanditPolicy, SlidingWindowUCB, ucb_index
from policies.base import Policy
from policies.decision import Decision
from policies.feedforward import FeedForwardPolicy, LinearLatencyModel, SpeedCurve, SpeedPoint
from policies.guards import FailSafe, Hysteresis, QualityGuard, RateLimit, TierClamp, guarded
from policies.mpc import ModelPredictivePolicy
from policies.operating_model import OperatingModel, OperatingPoint, StepCost
from policies.pid import PID, PIDPolicy
from policies.registry import POLICY_NAMES, describe, make_policy
from policies.slo import CostTarget, SLOSpec, TierSLO
from policies.static import StaticPolicy
from policies.telemetry import LatencySummary, StepTotals, Telemetry, TierWindow

__all__ = [
    "POLICY_NAMES",
    "PID",
    "BanditPolicy",
    "CostTarget",
    "Decision",
    "FailSafe",
    "FeedForwardPolicy",
    "Hysteresis",
    "LatencySummary",
    "LinearLatencyModel",
    "ModelPredictivePolicy",
    "OperatingModel",
    "OperatingPoint",
    "PIDPolicy",
    "Policy",
    "QualityGuard",
    "RateLimit",
    "SLOSpec",
    "SlidingWindowUCB",
    "SpeedCurve",
    "SpeedPoint",
    "StaticPolicy",
    "StepCost",
    "StepTotals",
    "Telemetry",
    "TierClamp",
    "TierSLO",
    "TierWindow",
    "describe",
    "guarded",
    "make_policy",
    "ucb_index",
]
