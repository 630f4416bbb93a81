"""Discrete-event cluster simulator that runs the real planner in virtual time."""
