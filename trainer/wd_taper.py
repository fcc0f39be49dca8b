"""The Muon weight decay's taper (WD_TAPER_FINAL_MULT != 1; PR #1729). trainer/schedule.py's set_step_schedule
calls it only with the taper on, so a record's train_gpt.py packed without it carries none of this.
"""

# the packed train_gpt.py holds it only for runs with the taper on (kit/bundle_when.py)
PACKED_WHEN = "WD_TAPER_FINAL_MULT != 1"


def wd_taper_multiplier(progress: float, start_frac: float, final_mult: float, /) -> float:
    """The Muon weight decay's multiplier (PR #1729): 1.0 until `start_frac` of the run, then linear to
    `final_mult` at its end (0.70 -> 0.5x in the record). final_mult = 1: 1.0 throughout (off)."""
    if final_mult == 1.0 or progress <= start_frac or start_frac >= 1.0:
        return 1.0
    return 1.0 + (final_mult - 1.0) * min(1.0, (progress - start_frac) / (1.0 - start_frac))
