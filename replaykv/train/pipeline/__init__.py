"""Pipeline-parallel training of V4.1 with CSA2's cross-stage state: the stage plan
(:mod:`.plan`), one stage (:mod:`.stage`) and the launcher and loop (:mod:`.run`)."""
