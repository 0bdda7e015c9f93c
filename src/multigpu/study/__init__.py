"""The scaling study: run a workload at several world sizes and batch policies; measure and judge.

``run`` plans and executes the runs through the launcher, ``measure`` reads
each run's metrics back and groups them, ``cli`` is ``multigpu study``.
"""

from .cli import add_arguments, main
from .measure import breakdown, headline, measure_run, summarize
from .run import POLICIES, RECIPES, Recipe, RunSpec, StudyConfig, plan_runs, run_study

__all__ = ["POLICIES", "RECIPES", "Recipe", "RunSpec", "StudyConfig", "add_arguments", "breakdown",
           "headline", "main", "measure_run", "plan_runs", "run_study", "summarize"]
