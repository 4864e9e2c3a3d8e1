"""The launcher side of a run: validate, place the run directory, start (and restart) workers through
torch's elastic agent, join machines, supervise signals and name the culprit of a failure."""
