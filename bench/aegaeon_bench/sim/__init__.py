"""Discrete-event simulator driving the same libs/sched policy objects as the services."""
