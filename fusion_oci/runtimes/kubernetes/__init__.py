"""The ``kubernetes`` runtime: tasks in Pods of the team's cluster (issue #34)."""
