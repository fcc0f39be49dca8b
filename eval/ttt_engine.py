"""What a score-first TTT mode builds on: the walk over the val stream in legal order (eval/walk.py: the run,
the schedule, the ledger, the time guard, run_score_first) and the updater that trains nothing
(eval/sliding.py Scorer, the sliding pass's), whose subclasses are the modes' updaters (eval/ttt_modes.py).
The sliding pass is the same walk with no updater: with no update a mode scores what it scores.
"""

from eval.sliding import Scorer
from eval.walk import Schedule, TTTRun, run_score_first

# the packed train_gpt.py holds this module only for runs with score-first TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED"

__all__ = ["Schedule", "Scorer", "TTTRun", "run_score_first"]
