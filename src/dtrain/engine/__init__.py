"""What runs in each slot: the worker process, the step loop, the two user APIs (Trial and ``dtrain.init``),
data, metrics, precision, checkpoints, and the agreement on where to stop."""
