"""The final eval's plan: one object (EvalPlan: stride, TTT epochs and phases, mode, projected seconds and
why), made from measured timings (the TTT planner: eval/ttt_plan.py) and passed whole from the plan to the run
(trainer/finish.py), the artifact's recorded TTT settings, result.json, the score command and
tools/bench/gpu_check.py.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """stride: the sliding / TTT scoring stride; epochs: TTT epochs (0: the sliding pass scores); phases: the
    TTT phases of a mode with phases (0: none); mode: TTT_MODE ("" without TTT); projected_seconds: the
    plan's projection with the roundtrip (None: not projected); reason: what the plan cut, or why TTT is
    skipped (None: nothing); roundtrip_seconds; wanted_seconds: the projection of the settings as asked (at
    EVAL_STRIDE, TTT_EPOCHS, TTT_PHASES; None: not projected); work: the LoRA schedule's counts (lora only)."""
    stride: int
    epochs: int = 0
    phases: int = 0
    mode: str = ""
    projected_seconds: float | None = None
    reason: str | None = None
    roundtrip_seconds: float = 0.0
    wanted_seconds: float | None = None
    work: dict | None = None

    def saved(self) -> dict:
        """The entries a resumable run keeps (trainer/interrupt.py TRAINED_FILE) and result.json repeats."""
        return dict(eval_stride=self.stride, ttt_epochs=self.epochs, ttt_phases=self.phases)

    @classmethod
    def from_saved(cls, saved: dict, mode: str = "") -> "EvalPlan":
        """The plan of an interrupted run from its saved entries (older files: no TTT epochs or phases)."""
        return cls(stride=saved["eval_stride"], epochs=saved.get("ttt_epochs", 0), phases=saved.get("ttt_phases", 0),
                   mode=mode * bool(saved.get("ttt_epochs", 0)))
