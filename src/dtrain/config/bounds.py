"""The strict base of every config section and the bounds every number in a config respects.

Torch-free and importing nothing of dtrain's: the config schema and each strategy's options
(:mod:`dtrain.sync.options`) build on it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Upper bounds: far above any real run, low enough that no value can exhaust the machine, overflow a
# timedelta or a 64-bit seed, or make a loop run for ever (see docs/security.md, "How input is validated").
MAX_SLOTS = 4096
MAX_LOADER_WORKERS = 256
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0
MAX_BATCHES = 10**12
MAX_EPOCHS = 10**9
MAX_STEPS = 10**9
MAX_FUSION_MB = 4096.0
MAX_GLOBAL_BATCH = 2**24
MAX_SEED = 2**63 - 1
MAX_NAME_CHARS = 100
MAX_PATH_CHARS = 1024


class Strict(BaseModel):
    # strict: no coercion, so `true` or "64" is not an integer and "1.5" not a number (ints are numbers).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)
