"""Property tests over hostile input. Short in `make test`; `make fuzz` raises the example count
(PHALANX_FUZZ_EXAMPLES) for a long run."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("phalanx", max_examples=int(os.environ.get("PHALANX_FUZZ_EXAMPLES", "150")),
                          deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("phalanx")
