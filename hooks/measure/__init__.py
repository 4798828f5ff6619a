"""Measure: one step's values on the device (the recorder, its slot buffer and observation log), the
inputs' fingerprint, attention-backend prediction and the logit bound, and the pure decode of a step's host
copy. Imports nothing above it in ``nanwatch.hooks``.
"""

__all__ = ["call_stack", "collective", "compiled", "decode", "dtypes", "inputs", "kept_forward",
           "logit", "observations", "optimizer_check", "param_sweep", "recorder", "replica_verdict", "rlhf",
           "scaler_overflow", "sdpa_backend", "sdpa_rules", "slot_buffer", "structure"]
