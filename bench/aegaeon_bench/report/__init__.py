"""The numbers and figures of a run: metrics from its trace, plots, the sweep's file."""
