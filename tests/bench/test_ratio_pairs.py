"""Which ratios the training benchmark reports: every system against DDP, phalanx against DDP as
users run it, and the A/A control (DDP against itself)."""


def test_the_aa_control_is_ddp_set_up_alike_and_is_compared_with_ddp():
    from phalanx.bench.training import DDP_SETUPS, SYSTEMS, _ratio_pairs

    assert DDP_SETUPS["ddp-again"] == DDP_SETUPS["ddp"]  # same malloc, same scheduling: only the noise differs
    assert ("ddp-again", "ddp") in _ratio_pairs(SYSTEMS + ("ddp-again",))
    assert ("ddp-again", "ddp-os-sched") not in _ratio_pairs(SYSTEMS + ("ddp-os-sched", "ddp-again"))
