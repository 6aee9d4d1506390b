"""mode=plan: the floor and every eviction policy's residency at the budget, no simulation."""
from __future__ import annotations

from engine.job import Job, Outcome, plan_report
from engine.report import plan_md


def plan_mode(job: Job) -> Outcome:
    return Outcome(plan_report(job), plan_md(job.plan.as_dict()))
