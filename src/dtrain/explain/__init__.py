"""What the measurements mean: the doctor, the planner, verification by running, scaling and strategy
comparisons, the end-of-run summary and the HTML report."""
